"""Power of two choices: of two pods drawn at random, the less loaded.

vllm-router's and sglang-router's ``power_of_two``. Least-loaded sends every request
to the one pod that looks least busy *to this gateway*; when several gateway replicas
or workers decide at once from views that lag each other, they all pick that pod and
herd onto it. Two random choices keep nearly all of least-loaded's balance (the
classic result: the longest queue grows as log log n instead of log n for one random
choice) while replicas that decide at once mostly pick different pods. Load is
``least_loaded_key``'s (in-flight at the gateway, then the engine's queue), without
its last resort, the pod id: a tie goes to the pod drawn first.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvindex.types import PrefixMatch
from routing.strategy_registry import register
from routing.types import Decision, PodView, Reason, RouteRequest, Strategy, least_loaded_key


@register("power-of-two", aliases=("p2c", "power-of-two-choices"))
class PowerOfTwo(Strategy):
    def __init__(self, seed: int | None = None) -> None:
        """``seed``: for reproducible draws (tests, simulations); None: from the OS."""
        self._rng = random.Random(seed)

    def pick(
        self,
        req: RouteRequest,
        pods: Sequence[PodView],
        match: PrefixMatch | None,
        now: float,
    ) -> Decision:
        if len(pods) == 1:
            return Decision(pod=pods[0].id, strategy=self.name, reason=Reason.LEAST_LOADED)
        a, b = self._rng.sample(range(len(pods)), 2)
        # A tie goes to the first drawn, not to the smaller id: idle pods share the
        # requests, and replicas that tie do not all pick the same pod.
        pod = pods[b] if _load(pods[b]) < _load(pods[a]) else pods[a]
        return Decision(pod=pod.id, strategy=self.name, reason=Reason.LEAST_LOADED)


def _load(pod: PodView) -> tuple[int, ...]:
    return least_loaded_key(pod)[:3]  # its order without the id that breaks ties
