"""Warm start: a gateway that joins or restarts routes on a full index at once.

With the memory index, a new process knows nothing of what the pods hold, and an idle
pod may publish no event for minutes. So the subscriber of every pod replays the
pod's KV-event history from its replay endpoint as soon as it connects
(``index.warm_start``), and ``/ready`` answers 503 ("warming") until the replay of
every pod followed so far has ended (pods found by discovery before the gateway was
first ready included): a load balancer sends the replica traffic only once it routes
cache hits as well as the replicas that were already there. A replay that gets no
answer ends after the subscriber's replay timeout, so a pod without a working replay
endpoint delays readiness by seconds, not forever; pods that join a ready gateway
never make it unready.

With a Redis index the index is shared: a new replica is warm at once, and the replay
only refills its local fallback view.

What vLLM can replay is what its publisher still buffers (``buffer_steps`` batches,
10,000 by default): on a pod whose history is longer, blocks stored before that and
still cached stay unknown until they are stored again.
"""

from __future__ import annotations

from gateway.kv import KvIndex


class WarmStart:
    """Whether the index has replayed what the followed pods held before it followed them."""

    def __init__(self, kv: KvIndex, shared_index: bool) -> None:
        self._kv = kv
        self._shared = shared_index
        self._warm = shared_index  # once warm, for good

    def warming(self) -> list[str]:
        """Followed pods whose start-up replay has not ended; empty once none had, and
        from then on (pods that join a ready gateway do not make it unready)."""
        if self._warm:
            return []
        waiting = sorted(p for p in self._kv.followed_pods() if not self._kv.history_replayed(p))
        if not waiting:
            self._warm = True
        return waiting

    @property
    def state(self) -> str:
        """For ``/ready``: ``shared`` (Redis), ``warm`` or ``warming``."""
        if self._shared:
            return "shared"
        return "warming" if self.warming() else "warm"
