"""Warm start: a gateway that joins or restarts routes on a full index at once.

With the memory index, a new process knows nothing of what the pods hold, and an idle
pod may publish no event for minutes. So the subscriber of every pod admitted at
start-up replays the pod's KV-event history from its replay endpoint as soon as it
connects (``index.warm_start``), and ``/ready`` answers 503 ("warming") until every
one of those replays has ended: a load balancer sends the replica traffic only once
it routes cache hits as well as the replicas that were already there. A replay that
gets no answer ends after the subscriber's replay timeout, so a pod without a working
replay endpoint delays readiness by seconds, not forever; pods that join later never
make a ready gateway unready.

With a Redis index the index is shared: a new replica is warm at once, and the replay
only refills its local fallback view.

What vLLM can replay is what its publisher still buffers (``buffer_steps`` batches,
10,000 by default): on a pod whose history is longer, blocks stored before that and
still cached stay unknown until they are stored again.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.kv import KvIndex


class WarmStart:
    """Which start-up pods' history is still being replayed."""

    def __init__(self, kv: KvIndex, shared_index: bool) -> None:
        self._kv = kv
        self._shared = shared_index
        self._pending: set[str] | None = None  # None: nothing to wait for (any more)

    def begin(self, pods: Iterable[str]) -> None:
        """The pods admitted at start-up; those whose events are followed are waited for."""
        if self._shared:
            return
        self._pending = {p for p in pods if self._kv.history_replayed(p) is not None}

    def warming(self) -> list[str]:
        """Start-up pods whose replay has not ended; empty once all have, for good."""
        if self._pending is None:
            return []
        waiting = sorted(p for p in self._pending if self._kv.history_replayed(p) is False)
        if not waiting:
            self._pending = None
        return waiting

    @property
    def state(self) -> str:
        """For ``/ready``: ``shared`` (Redis), ``warm`` or ``warming``."""
        if self._shared:
            return "shared"
        return "warming" if self.warming() else "warm"
