"""In-flight load per pod, counted at dispatch and released in ``finally``.

A counter that only moves after the first byte lets a burst of identical requests
all see the same "idle" pod; counting synchronously at dispatch (before the first
await) is what keeps cache-aware strategies from collapsing onto one pod.

Where the counts live is behind one seam, ``LoadView``: the routing core asks it for
a pod's load (``get``) and counts a dispatched request against a pod (``start``).
``LoadTracker`` (this process's own dispatches) is the default and all the
discrete-event simulator needs. A gateway scaled out over worker processes or
replicas plugs in a view that adds what the other processes dispatched
(``CombinedLoad`` over a ``LoadSource``; the gateway's shared-memory and Redis
sources live in ``gateway/``), so every process routes on the fleet-wide load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvindex.types import Bound


class LoadCell(Protocol):
    """The counters one pod's dispatched requests move (in this process or shared)."""

    def add(self, in_flight: int, prefill_tokens: int, prefilling: int) -> None:
        """Add the deltas; no counter goes below zero."""
        ...


@dataclass(slots=True)
class PodLoad:
    in_flight: int = 0
    prefill_tokens: int = 0  # uncached prompt tokens still to be prefilled
    prefilling: int = 0  # requests that have not produced their first token yet

    def add(self, in_flight: int, prefill_tokens: int, prefilling: int) -> None:
        self.in_flight = max(0, self.in_flight + in_flight)
        self.prefill_tokens = max(0, self.prefill_tokens + prefill_tokens)
        self.prefilling = max(0, self.prefilling + prefilling)

    def plus(self, other: PodLoad) -> PodLoad:
        """A new ``PodLoad``: these counts and ``other``'s together."""
        return PodLoad(
            self.in_flight + other.in_flight,
            self.prefill_tokens + other.prefill_tokens,
            self.prefilling + other.prefilling,
        )

    @property
    def idle(self) -> bool:
        return not (self.in_flight or self.prefill_tokens or self.prefilling)


class InFlight:
    """One dispatched request's share of a pod's load; every release is idempotent."""

    __slots__ = ("_cell", "_prefill", "_prefilling", "_done")

    def __init__(self, cell: LoadCell, prefill_tokens: int) -> None:
        self._cell = cell
        self._prefill = prefill_tokens
        self._prefilling = True
        self._done = False
        cell.add(1, prefill_tokens, 1)

    def first_token(self) -> None:
        """The pod finished this prompt's prefill; only the decode slot remains."""
        if not self._prefilling:
            return
        self._prefilling = False
        self._cell.add(0, -self._prefill, -1)
        self._prefill = 0

    @property
    def finished(self) -> bool:
        return self._done

    def finish(self) -> None:
        if self._done:
            return
        self._done = True
        self.first_token()
        self._cell.add(-1, 0, 0)


@runtime_checkable
class LoadView(Protocol):
    """What the routing core needs of load: read a pod's, count a request against one."""

    def get(self, pod: str) -> PodLoad:
        """The load routing should see on ``pod`` now (a snapshot or a live object)."""
        ...

    def start(self, pod: str, prefill_tokens: int = 0) -> InFlight:
        """Count a request against ``pod`` now; call ``finish()`` in a ``finally``."""
        ...

    def forget(self, pod: str) -> None:
        """The pod left the fleet: its (idle) counters go, in-flight ones finish alone."""
        ...

    def bound(self) -> Bound:
        """How many pods this view holds counters for, against its capacity."""
        ...

    def __contains__(self, pod: object) -> bool: ...


MAX_PODS = 10_000  # pods tracked at once; the registry (discovery) has its own bound


class LoadTracker:
    """This process's own dispatches: the default ``LoadView`` (and the DES's)."""

    def __init__(self) -> None:
        self._pods: dict[str, PodLoad] = {}  # at most MAX_PODS

    def bound(self) -> Bound:
        return Bound(len(self._pods), MAX_PODS, "pods", 200)

    def __contains__(self, pod: object) -> bool:
        return pod in self._pods

    def get(self, pod: str) -> PodLoad:
        return self._pods.get(pod) or PodLoad()

    def start(self, pod: str, prefill_tokens: int = 0) -> InFlight:
        """Count a request against ``pod`` now; call ``finish()`` in a ``finally``."""
        return InFlight(self.cell(pod), prefill_tokens)

    def cell(self, pod: str) -> LoadCell:
        """The counters a request on ``pod`` moves (made on first use)."""
        load = self._pods.get(pod)
        if load is None:
            if len(self._pods) >= MAX_PODS:  # pods that left without forget(): idle ones go
                for name in [n for n, p in self._pods.items() if not p.in_flight]:
                    del self._pods[name]
            load = self._pods[pod] = PodLoad()
        return load

    def forget(self, pod: str) -> None:
        """The pod left the fleet: its (idle) counters go, in-flight ones finish alone."""
        self._pods.pop(pod, None)

    def snapshot(self) -> dict[str, PodLoad]:
        """A copy of every non-idle pod's counts (what a replica publishes)."""
        return {
            pod: PodLoad(v.in_flight, v.prefill_tokens, v.prefilling)
            for pod, v in self._pods.items()
            if not v.idle
        }


class LoadSource(Protocol):
    """Load that other routers dispatched, as last heard (a shared-memory table, Redis)."""

    def others(self, pod: str) -> PodLoad | None:
        """What the other routers count against ``pod``; None: nothing known."""
        ...


class CombinedLoad:
    """A ``LoadView`` over a local view plus what other routers dispatched.

    Requests are counted in ``local`` (this router's own, exact and at once); ``get``
    adds each ``source``'s view of the others. The sources never see this router's
    own counts twice: each reports only the *other* routers."""

    def __init__(self, local: LoadView, sources: Mapping[str, LoadSource]) -> None:
        self.local = local
        self.sources = dict(sources)

    def get(self, pod: str) -> PodLoad:
        load = self.local.get(pod)
        for source in self.sources.values():
            other = source.others(pod)
            if other is not None:
                load = load.plus(other)
        return load

    def start(self, pod: str, prefill_tokens: int = 0) -> InFlight:
        return self.local.start(pod, prefill_tokens)

    def forget(self, pod: str) -> None:
        self.local.forget(pod)

    def bound(self) -> Bound:
        return self.local.bound()

    def __contains__(self, pod: object) -> bool:
        return pod in self.local
