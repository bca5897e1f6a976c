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
(``health.retry_in_flight_on_eject``).

A stream whose client has its status line cannot change pods. It is told its pod was
lost (``QuietWatch.pod_lost``) and ends with an SSE error event once the pod has sent
it nothing for a probe interval, instead of after ``stream_idle_s`` (60 s by default)
or, before its first byte, ``first_byte_s``: a stream the lost pod still feeds goes
on, so a pod too busy to answer its probes in time does not lose its answers.

One table per process, kept across reloads like the in-flight bounds; an entry
lives while an attempt waits on its pod: from dispatch to its first byte towards the
client (or its end), and while a stream is relayed. So it holds at most the requests
in flight (``max_requests_in_flight``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Generic, Protocol, TypeVar

from gateway.accounting import Attempt
from gateway.pods import Pod

log = logging.getLogger("kvgate.awaiting")
_OUTSIDE_A_TASK = contextlib.nullcontext()  # nothing to cancel: not waited on
V = TypeVar("V")


class QuietWatch(Protocol):
    """A stream's watch on its pod's silence (the proxy's ``_QuietPod``)."""

    def pod_lost(self) -> None:
        """The pod failed its probes: end the stream once it is quiet for a probe
        interval (at once if it has been already)."""


class _ByPod(Generic[V]):
    """pod name -> id(attempt) -> V; a pod's inner dict goes when it empties."""

    __slots__ = ("_by_pod",)

    def __init__(self) -> None:
        self._by_pod: dict[str, dict[int, V]] = {}

    def add(self, a: Attempt, value: V) -> None:
        entries = self._by_pod.get(a.pod.name)
        if entries is None:
            entries = self._by_pod[a.pod.name] = {}
        entries[id(a)] = value

    def remove(self, a: Attempt) -> None:
        entries = self._by_pod.get(a.pod.name)
        if entries is not None and entries.pop(id(a), None) is not None and not entries:
            del self._by_pod[a.pod.name]

    def take(self, pod: str) -> list[V]:
        """Every entry of ``pod``, removed."""
        return list(self._by_pod.pop(pod, {}).values())

    def count(self, pod: str) -> int:
        return len(self._by_pod.get(pod, ()))


class _Entry(Generic[V]):
    """``with``: ``a`` is in ``table`` (as ``value``) from entry to exit, however the
    block ends."""

    __slots__ = ("_a", "_table", "_value")

    def __init__(self, table: _ByPod[V], a: Attempt, value: V) -> None:
        self._table = table
        self._a = a
        self._value = value

    def __enter__(self) -> None:
        self._table.add(self._a, self._value)

    def __exit__(self, *exc: object) -> None:
        self._table.remove(self._a)


class AwaitingPods:
    """By pod: the attempts in flight whose client has seen nothing yet, and the
    streams being relayed to a client that has its status line."""

    __slots__ = ("_relaying", "_waiting")

    def __init__(self) -> None:
        # the attempts whose client has seen nothing, with the request's task
        self._waiting: _ByPod[tuple[Attempt, asyncio.Task[object]]] = _ByPod()
        # the watch of each stream whose client has its status line
        self._relaying: _ByPod[QuietWatch] = _ByPod()

    def holding(self, a: Attempt) -> contextlib.AbstractContextManager[None]:
        """``with`` around the attempt's call, from its task: it waits on its pod from
        entry until it answers its client (``leave``) or the call ends, however it
        ends, so that none of the caller's handling after it (a retry's backoff) can be
        cancelled for it."""
        task = asyncio.current_task()
        if task is None:
            return _OUTSIDE_A_TASK
        return _Entry(self._waiting, a, (a, task))

    def enter(self, a: Attempt) -> None:
        """``a`` was dispatched from the current task."""
        task = asyncio.current_task()
        if task is not None:
            self._waiting.add(a, (a, task))

    def leave(self, a: Attempt) -> None:
        """``a`` ended, or is about to send its client a first byte."""
        self._waiting.remove(a)

    def relaying(self, a: Attempt, quiet: QuietWatch) -> contextlib.AbstractContextManager[None]:
        """``with`` around the part of a stream that waits on its pod after its client
        has the status line: a lost pod tells ``quiet``."""
        return _Entry(self._relaying, a, quiet)

    def pod_lost(self, pod: Pod) -> None:
        """``pod`` stopped answering its probes: cancel what waits on it, to be retried
        (the proxy tells this cancellation from a client's leaving by ``a.lost``), and
        tell the streams it feeds."""
        waiting = self._waiting.take(pod.name)
        for a, task in waiting:
            a.lost = True
            task.cancel()
        relaying = self._relaying.take(pod.name)
        for quiet in relaying:
            quiet.pod_lost()
        if waiting or relaying:
            log.warning("pod %s lost with %d requests waiting on it (retried elsewhere) "
                        "and %d streams (ended if it stays quiet)",
                        pod.name, len(waiting), len(relaying))  # fmt: skip

    def waiting(self, pod: str) -> int:
        return self._waiting.count(pod)

    def relayed(self, pod: str) -> int:
        return self._relaying.count(pod)
