"""Round-robin: rotate through the healthy pods, ignoring cache and load."""

from __future__ import annotations

from collections.abc import Sequence

from kvindex.types import PrefixMatch
from routing.strategy_registry import register
from routing.types import Decision, PodView, Reason, RouteRequest, Strategy


@register("round-robin", aliases=("roundrobin", "rr"))
class RoundRobin(Strategy):
    def __init__(self) -> None:
        self._counter = 0

    def pick(
        self,
        req: RouteRequest,
        pods: Sequence[PodView],
        match: PrefixMatch | None,
        now: float,
    ) -> Decision:
        # Sort by id so the rotation is stable while pods come and go.
        ordered = sorted(pods, key=lambda p: p.id)
        pod = ordered[self._counter % len(ordered)]
        self._counter += 1
        return Decision(pod=pod.id, strategy=self.name, reason=Reason.ROTATION)
