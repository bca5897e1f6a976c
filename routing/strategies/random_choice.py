"""Random: each request to a healthy pod drawn uniformly, ignoring cache and load.

vllm-router's and sglang-router's ``random``: the baseline that needs no state at all,
so any number of gateway replicas and workers spread alike without sharing anything.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvindex.types import PrefixMatch
from routing.strategy_registry import register
from routing.types import Decision, PodView, Reason, RouteRequest, Strategy


@register("random")
class RandomChoice(Strategy):
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
        pod = pods[self._rng.randrange(len(pods))]
        return Decision(pod=pod.id, strategy=self.name, reason=Reason.RANDOM)
