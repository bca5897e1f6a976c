"""Least-loaded: fewest in-flight requests at this gateway, then engine queue."""

from __future__ import annotations

from collections.abc import Sequence

from kvindex.types import PrefixMatch
from routing.registry import register
from routing.types import (
    Decision,
    NoCandidates,
    Outcome,
    PodView,
    Reason,
    RouteRequest,
    least_loaded_key,
)


@register("least-loaded", aliases=("leastloaded", "least-request", "ll"))
class LeastLoaded:
    name = "least-loaded"

    def choose(
        self,
        req: RouteRequest,
        pods: Sequence[PodView],
        match: PrefixMatch | None,
        now: float,
    ) -> Decision:
        if not pods:
            raise NoCandidates(req.model)
        pod = min(pods, key=least_loaded_key)
        return Decision(pod=pod.id, strategy=self.name, reason=Reason.LEAST_LOADED)

    def observe(self, req: RouteRequest, decision: Decision, outcome: Outcome) -> None:
        return None
