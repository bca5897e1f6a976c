"""Requests waiting on a pod that has sent their client nothing yet, so that a pod
which stops answering its probes does not keep them.

A pod that hangs whole (a frozen process, a node that went away, a partition) keeps
the connections of the requests it was serving open and silent. Without more, each
would wait for its deadline: a stream ``first_byte_s`` (120 s by default), a
non-streamed answer ``total_s`` (900 s), since vLLM sends it whole at the end. The
health probes find such a pod within ``eject_after_failed_probes`` intervals and
eject it; from then on nothing new goes there, and the requests it holds are doomed
too. When a pod is ejected for failing its probes (``PodRegistry.on_lost``), every
request still waiting on it and of which the client has seen nothing (no status
line, no byte) is cancelled and goes to another pod, as a connect error would
(``health.retry_in_flight_on_eject``; a request whose client has its status line
goes on waiting: its answer cannot change pods).

One table per process, kept across reloads like the in-flight bounds; an entry
lives from an attempt's dispatch to its first byte towards the client (or its end),
so it holds at most the requests in flight (``max_requests_in_flight``).
"""

from __future__ import annotations

import asyncio
import logging

from gateway.accounting import Attempt
from gateway.pods import Pod

log = logging.getLogger("kvgate.awaiting")


class AwaitingPods:
    """Attempts in flight whose client has seen nothing yet, by pod."""

    __slots__ = ("_by_pod",)

    def __init__(self) -> None:
        # pod name -> id(attempt) -> (attempt, the request's task)
        self._by_pod: dict[str, dict[int, tuple[Attempt, asyncio.Task[object]]]] = {}

    def holding(self, a: Attempt) -> AttemptWaiting:
        """``with`` around the attempt's call: it waits on its pod from entry until it
        answers its client (``leave``) or the call ends, however it ends, so that none
        of the caller's handling after it (a retry's backoff) can be cancelled for it."""
        return AttemptWaiting(self, a)

    def enter(self, a: Attempt) -> None:
        """``a`` was dispatched from the current task."""
        task = asyncio.current_task()
        if task is None:
            return
        waiting = self._by_pod.get(a.pod.name)
        if waiting is None:
            waiting = self._by_pod[a.pod.name] = {}
        waiting[id(a)] = (a, task)

    def leave(self, a: Attempt) -> None:
        """``a`` ended, or is about to send its client a first byte."""
        waiting = self._by_pod.get(a.pod.name)
        if waiting is not None and waiting.pop(id(a), None) is not None and not waiting:
            del self._by_pod[a.pod.name]

    def pod_lost(self, pod: Pod) -> None:
        """``pod`` stopped answering its probes: cancel what waits on it, to be retried
        (the proxy tells this cancellation from a client's leaving by ``a.lost``)."""
        waiting = self._by_pod.pop(pod.name, {})
        for a, task in waiting.values():
            a.lost = True
            task.cancel()
        if waiting:
            log.warning("pod %s lost with %d requests waiting on it: retried elsewhere",
                        pod.name, len(waiting))  # fmt: skip

    def waiting(self, pod: str) -> int:
        return len(self._by_pod.get(pod, ()))


class AttemptWaiting:
    """``AwaitingPods.holding``'s context manager."""

    __slots__ = ("_a", "_table")

    def __init__(self, table: AwaitingPods, a: Attempt) -> None:
        self._table = table
        self._a = a

    def __enter__(self) -> None:
        self._table.enter(self._a)

    def __exit__(self, *exc: object) -> None:
        self._table.leave(self._a)
