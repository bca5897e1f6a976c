"""In-flight load per pod, counted at dispatch and released in ``finally``.

A counter that only moves after the first byte lets a burst of identical requests
all see the same "idle" pod; counting synchronously at dispatch (before the first
await) is what keeps cache-aware strategies from collapsing onto one pod.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvindex.types import Bound


@dataclass(slots=True)
class PodLoad:
    in_flight: int = 0
    prefill_tokens: int = 0  # uncached prompt tokens still to be prefilled
    prefilling: int = 0  # requests that have not produced their first token yet


class InFlight:
    """One dispatched request's share of a pod's load; every release is idempotent."""

    __slots__ = ("_load", "_prefill", "_prefilling", "_done")

    def __init__(self, load: PodLoad, prefill_tokens: int) -> None:
        self._load = load
        self._prefill = prefill_tokens
        self._prefilling = True
        self._done = False
        load.in_flight += 1
        load.prefill_tokens += prefill_tokens
        load.prefilling += 1

    def first_token(self) -> None:
        """The pod finished this prompt's prefill; only the decode slot remains."""
        if not self._prefilling:
            return
        self._prefilling = False
        self._load.prefill_tokens = max(0, self._load.prefill_tokens - self._prefill)
        self._load.prefilling = max(0, self._load.prefilling - 1)
        self._prefill = 0

    @property
    def finished(self) -> bool:
        return self._done

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        self.first_token()
        self._load.in_flight = max(0, self._load.in_flight - 1)


MAX_PODS = 10_000  # pods tracked at once; the registry (discovery) has its own bound


class LoadTracker:
    def __init__(self) -> None:
        self._pods: dict[str, PodLoad] = {}

    def bound(self) -> Bound:
        return Bound(len(self._pods), MAX_PODS, "pods", 200)

    def __contains__(self, pod: object) -> bool:
        return pod in self._pods

    def get(self, pod: str) -> PodLoad:
        return self._pods.get(pod) or PodLoad()

    def start(self, pod: str, prefill_tokens: int = 0) -> InFlight:
        """Count a request against ``pod`` now; call ``finish()`` in a ``finally``."""
        load = self._pods.get(pod)
        if load is None:
            if len(self._pods) >= MAX_PODS:  # pods that left without forget(): idle ones go
                for name in [n for n, p in self._pods.items() if not p.in_flight]:
                    del self._pods[name]
            load = self._pods[pod] = PodLoad()
        return InFlight(load, prefill_tokens)

    def forget(self, pod: str) -> None:
        """The pod left the fleet: its (idle) counters go, in-flight ones finish alone."""
        self._pods.pop(pod, None)
