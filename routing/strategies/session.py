"""Session affinity: the same session key goes to the same pod, whose cache holds it.

The gateway fills ``RouteRequest.session_key`` from a configured header or body field
(e.g. OpenAI's ``user``). The home pod is chosen by rendezvous (highest random weight)
hashing over the healthy candidates: every gateway replica agrees without sharing
state, and a pod leaving moves only its own sessions. A bounded LRU remembers the
home of recent sessions so that a pod *joining* does not move anyone either (HRW
alone would move ~1/n of them). Keys are stored as 64-bit hashes, never verbatim.

Falls back to least-loaded without a key, and spills to the least-loaded pod (without
rehoming the session) while the home pod is overloaded per ``overloaded``.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvindex.lru import BoundedLRU
from kvindex.types import Bound, PrefixMatch
from routing.strategy_registry import register
from routing.types import (
    Decision,
    Need,
    PodView,
    Reason,
    RouteRequest,
    Strategy,
    least_loaded_key,
    overloaded,
)

_POD_SEEDS_CAPACITY = 4096  # distinct pod ids seen; pods churn on restarts


@register("session", aliases=("sticky", "session-affinity", "affinity"))
class SessionAffinity(Strategy):
    """Sticky routing by session key with consistent (rendezvous) hashing."""

    needs = frozenset({Need.SESSION})  # the gateway fills session_key from a header or body field

    def __init__(
        self,
        capacity: int = 100_000,
        balance_abs_threshold: int = 8,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        """``capacity``: sessions remembered (0 = pure rendezvous hashing, no memory)."""
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._homes: BoundedLRU[int, str] | None = BoundedLRU(capacity) if capacity else None
        self._pod_seeds: dict[str, int] = {}  # bounded by _POD_SEEDS_CAPACITY
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    @property
    def remembered(self) -> int:
        return len(self._homes) if self._homes is not None else 0

    def bounds(self) -> dict[str, Bound]:
        capacity = self._homes.capacity if self._homes is not None else 0
        return {
            "sessions": Bound(self.remembered, capacity, "sessions", 140),
            "pod_seeds": Bound(len(self._pod_seeds), _POD_SEEDS_CAPACITY, "pods", 150),
        }

    def pick(
        self,
        req: RouteRequest,
        pods: Sequence[PodView],
        match: PrefixMatch | None,
        now: float,
    ) -> Decision:
        if not req.session_key:
            least = min(pods, key=least_loaded_key)
            return Decision(pod=least.id, strategy=self.name, reason=Reason.FALLBACK)
        home = self._home(req.session_key, pods)
        # The home cannot be overloaded while its own in-flight is within the gap.
        if home.in_flight > self.balance_abs_threshold:
            least = min(pods, key=least_loaded_key)
            if home.id != least.id and overloaded(
                home, least, self.balance_abs_threshold, self.balance_rel_threshold
            ):
                return Decision(pod=least.id, strategy=self.name, reason=Reason.LOAD_SPILL)
        return Decision(pod=home.id, strategy=self.name, reason=Reason.SESSION)

    def _home(self, session_key: str, pods: Sequence[PodView]) -> PodView:
        key = session_key.encode("utf-8", "surrogatepass")
        homes = self._homes
        if homes is None:
            return self._rendezvous(key, pods)
        key_hash = xxhash.xxh3_64_intdigest(key)
        remembered = homes.get(key_hash)
        if remembered is not None:
            for pod in pods:
                if pod.id == remembered:
                    homes.touch(key_hash)
                    return pod
        pod = self._rendezvous(key, pods)
        homes.put(key_hash, pod.id)
        return pod

    def _rendezvous(self, key: bytes, pods: Sequence[PodView]) -> PodView:
        """Highest-random-weight pod for ``key``; ties (64-bit) broken by id."""
        digest = xxhash.xxh3_64_intdigest
        seeds = self._pod_seeds
        best, best_score = pods[0], (-1, "")
        for pod in pods:
            seed = seeds.get(pod.id)
            if seed is None:
                seed = self._new_seed(pod.id)
            score = (digest(key, seed), pod.id)
            if score > best_score:
                best, best_score = pod, score
        return best

    def _new_seed(self, pod_id: str) -> int:
        if len(self._pod_seeds) >= _POD_SEEDS_CAPACITY:  # pods churn on restarts
            self._pod_seeds.clear()
        seed = xxhash.xxh3_64_intdigest(pod_id.encode("utf-8", "surrogatepass"))
        self._pod_seeds[pod_id] = seed
        return seed
