"""Least-loaded: fewest in-flight requests at this gateway, then engine queue."""

from __future__ import annotations

from collections.abc import Sequence

from kvindex.types import PrefixMatch
from routing.strategy_registry import register
from routing.types import Decision, PodView, Reason, RouteRequest, Strategy, least_loaded_key


@register("least-loaded", aliases=("leastloaded", "least-request", "ll"))
class LeastLoaded(Strategy):
    def pick(
        self,
        req: RouteRequest,
        pods: Sequence[PodView],
        match: PrefixMatch | None,
        now: float,
    ) -> Decision:
        pod = min(pods, key=least_loaded_key)
        return Decision(pod=pod.id, strategy=self.name, reason=Reason.LEAST_LOADED)
