"""Admission control: which request may go to a pod now, which waits, which is turned away.

One ``AdmissionQueue`` per served model. A request arrives with a priority (0 is the
most urgent), a tenant and a TTFT SLO. It is dispatched at once when no request of
its priority or higher waits, some pod is under its in-flight limit and its predicted
TTFT fits the SLO. Otherwise it waits, or is shed (429 upstream of here):

* ``queue_full``: the model's queue already holds ``max_queue`` requests;
* ``slo``: with ``slo_action="shed"``, its predicted TTFT (the strategy's prediction
  on the pod it would get, plus the expected wait for a slot) exceeds its SLO;
* ``queue_timeout``: it waited ``max_wait_s`` (the caller's timer says so).

With ``slo_action="queue"`` a request predicted over its SLO waits in the gateway
instead of joining a pod's queue, and goes once its prediction fits (or the pod it
would get has nothing of ours in flight, so waiting cannot make it faster): the
gateway's queue, where priorities and fairness apply, holds the excess, and the pods'
queues stay short.

Waiting requests leave in strict priority order; within a priority, tenants share
slots by start-time fair queueing (each tenant's requests are tagged with a virtual
start time that advances by ``1 / weight`` per request, the smallest tag goes next),
so a tenant that floods the queue delays only itself. Strategies that do not predict
TTFT are judged by queue position alone: the expected wait is the position over the
rate at which slots freed recently.

Pure: no sockets, no asyncio, no clock but the ``now`` the caller passes. The gateway
(``gateway.admission``) drives it with futures, the discrete-event simulator
(``bench.des.admission``) with simulated events, so both make the same decisions.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from kvindex.lru import BoundedLRU
from kvindex.types import Bound
from routing.load import PodLoad

SloAction = Literal["shed", "queue"]
VerdictKind = Literal["dispatch", "wait", "shed"]

QUEUE_FULL = "queue_full"
SLO = "slo"
QUEUE_TIMEOUT = "queue_timeout"
SHED_REASONS = (QUEUE_FULL, SLO, QUEUE_TIMEOUT)  # the metric's whole label vocabulary


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """One model's admission settings."""

    max_in_flight_per_pod: int = 0  # a pod holding this many of our requests is full; 0: no limit
    max_prefilling_per_pod: int = 0  # ... or this many before their first token; 0: no limit
    max_queue: int = 1000  # waiting requests of the model; beyond: shed (queue_full)
    max_wait_s: float = 30.0  # a request waiting this long is shed (queue_timeout)
    ttft_slo_s: float | None = None  # default SLO when the request names none
    slo_action: SloAction = "shed"
    priorities: int = 3  # levels 0 (most urgent) .. priorities - 1
    max_tenants: int = 1024  # tenants with a fair-queueing tag kept, per priority
    drain_window: int = 32  # recent dispatches the drain rate is measured over
    max_retry_after_s: int = 60

    def __post_init__(self) -> None:
        limits = (self.max_in_flight_per_pod, self.max_prefilling_per_pod, self.max_queue)
        if min(limits) < 0 or self.priorities < 1:
            raise ValueError("admission: limits must be >= 0 and priorities >= 1")
        if not self.max_wait_s > 0 or (self.ttft_slo_s is not None and not self.ttft_slo_s > 0):
            raise ValueError("admission: max_wait_s and ttft_slo_s must be > 0")
        if self.slo_action not in ("shed", "queue"):
            raise ValueError("admission: slo_action must be 'shed' or 'queue'")

    def has_room(self, load: PodLoad) -> bool:
        """Whether a pod with this router's ``load`` may take one more request."""
        limit, queue = self.max_in_flight_per_pod, self.max_prefilling_per_pod
        return (not limit or load.in_flight < limit) and (not queue or load.prefilling < queue)


@dataclass(frozen=True, slots=True)
class Offer:
    """What dispatching one request now would mean, as the caller's routing previews it."""

    free: bool  # some candidate pod is under its in-flight limit
    predicted_ttft_s: float | None = None  # on the pod it would get; None: no prediction
    pod_idle: bool = False  # that pod has none of our requests in flight
    decision: object = None  # the caller's own, handed back when the request may go


class Ticket:
    """One request before a pod: what admission weighs, and the caller's payload."""

    __slots__ = ("priority", "tenant", "weight", "slo_s", "arrived", "item", "state",
                 "_tag", "_seq")  # fmt: skip

    def __init__(
        self,
        arrived: float,
        priority: int = 0,
        tenant: str = "",
        *,
        weight: float = 1.0,
        slo_s: float | None = None,
        item: object = None,
    ) -> None:
        if not weight > 0:
            raise ValueError("a tenant's weight must be > 0")
        self.arrived = arrived
        self.priority = priority
        self.tenant = tenant
        self.weight = weight
        self.slo_s = slo_s
        self.item = item
        self.state: Literal["new", "waiting", "dispatched", "shed", "cancelled"] = "new"
        self._tag = 0.0
        self._seq = 0

    def __lt__(self, other: Ticket) -> bool:  # heap order within a priority
        return (self._tag, self._seq) < (other._tag, other._seq)


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: VerdictKind
    reason: str = ""  # a SHED_REASONS value when shed
    retry_after_s: int = 0  # for the client's Retry-After when shed
    predicted_ttft_s: float | None = None
    decision: object = None  # the offer's, when dispatched


Probe = Callable[[Ticket], Offer]


class AdmissionQueue:
    """One model's waiting requests, in priority then fair-tenant order."""

    def __init__(self, policy: AdmissionPolicy) -> None:
        self.policy = policy
        self._seq = 0
        self._dispatched: deque[float] = deque(maxlen=max(2, policy.drain_window))
        self._reset_levels()

    def _reset_levels(self) -> None:
        levels = self.policy.priorities
        self._heaps: list[list[Ticket]] = [[] for _ in range(levels)]
        self._waiting = [0] * levels  # live tickets per level (heaps also hold dead ones)
        self._vtime = [0.0] * levels
        self._finish: list[BoundedLRU[str, float]] = [
            BoundedLRU(self.policy.max_tenants) for _ in range(levels)
        ]

    def set_policy(self, policy: AdmissionPolicy, levels: Mapping[int, int] | None = None) -> None:
        """Admit by ``policy`` from now on (a configuration reload); waiting requests stay.

        When the priority levels or the tenant bound change, every waiter is queued
        again in its old order, at ``levels[old level]`` (default: the same level, or
        the least urgent one that is left); their fair-queueing tags start afresh."""
        same_shape = (policy.priorities, policy.max_tenants) == (
            self.policy.priorities, self.policy.max_tenants)  # fmt: skip
        self._dispatched = deque(self._dispatched, maxlen=max(2, policy.drain_window))
        if same_shape and not levels:
            self.policy = policy
            return
        waiters = sorted((t for heap in self._heaps for t in heap if t.state == "waiting"),
                         key=lambda t: (t.priority, t._tag, t._seq))  # fmt: skip
        self.policy = policy
        self._reset_levels()
        for t in waiters:
            level = (levels or {}).get(t.priority, t.priority)
            t.priority = min(max(level, 0), policy.priorities - 1)
            self._enqueue(t)

    # -- what the caller asks -------------------------------------------------------

    def arrive(self, t: Ticket, now: float, probe: Probe) -> Verdict:
        """Dispatch ``t`` now, let it wait, or shed it."""
        t.priority = min(max(t.priority, 0), len(self._heaps) - 1)
        slo = self.slo_of(t)
        ahead = self._ahead_of(t)
        offer = probe(t)
        if ahead == 0 and offer.free:
            predicted = offer.predicted_ttft_s
            if self._fits(offer, slo):
                t.state = "dispatched"
                self._dispatched.append(now)
                return Verdict("dispatch", predicted_ttft_s=predicted, decision=offer.decision)
        else:
            # Conservative: the pod's queue as it is now, after the wait for a slot (its
            # queue will have moved by then, but more urgent and fairer requests may
            # also overtake this one meanwhile).
            predicted = self.expected_wait_s(ahead) + (offer.predicted_ttft_s or 0.0)
            if slo is None or predicted <= slo:
                return self._wait(t, predicted)
        if self.policy.slo_action == "shed":
            assert predicted is not None and slo is not None
            return self._shed(t, SLO, predicted - slo, predicted)
        return self._wait(t, predicted)

    def next_ready(self, now: float, probe: Probe) -> tuple[Ticket, Verdict] | None:
        """The waiter that goes next and its dispatch, if it may go now; None while it
        may not. Call again after committing each one: the next probe must see its load."""
        head = self._head()
        if head is None:
            return None
        offer = probe(head)
        if not offer.free:
            return None
        if (self.policy.slo_action == "queue" and not offer.pod_idle
                and not self._fits(offer, self.slo_of(head))):  # fmt: skip
            return None
        self._pop(head)
        level = head.priority
        self._vtime[level] = max(self._vtime[level], head._tag)  # fair-queueing clock
        self._dispatched.append(now)
        verdict = Verdict("dispatch", predicted_ttft_s=offer.predicted_ttft_s,
                          decision=offer.decision)  # fmt: skip
        return head, verdict

    def head(self) -> Ticket | None:
        """The waiter that goes next."""
        return self._head()

    def time_out(self, t: Ticket) -> Verdict | None:
        """``t`` waited ``max_wait_s``: shed it, if it is still waiting."""
        if t.state != "waiting":
            return None
        self._pop(t)
        return self._shed(t, QUEUE_TIMEOUT, self.expected_wait_s(self.waiting))

    def cancel(self, t: Ticket) -> bool:
        """The client left; whether ``t`` was still waiting (and no longer is)."""
        if t.state != "waiting":
            return False
        self._pop(t)
        t.state = "cancelled"
        return True

    # -- what the caller reads ------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return sum(self._waiting)

    def lengths(self) -> list[int]:
        """Waiting requests per priority level."""
        return list(self._waiting)

    def slo_of(self, t: Ticket) -> float | None:
        return t.slo_s if t.slo_s is not None else self.policy.ttft_slo_s

    def drain_rate(self) -> float | None:
        """Requests dispatched per second lately (while pods are full, the rate at which
        they take new ones); None until there is a measurement."""
        r = self._dispatched
        if len(r) < 2 or r[-1] <= r[0]:
            return None
        return (len(r) - 1) / (r[-1] - r[0])

    def expected_wait_s(self, ahead: int) -> float:
        """Until a slot frees for the request behind ``ahead`` others (0 if unknown)."""
        rate = self.drain_rate()
        return (ahead + 1) / rate if rate else 0.0

    def bounds(self) -> dict[str, Bound]:
        """Waiting requests (a ticket, the gateway's waiter and future: ~390 B measured
        with tracemalloc, the request's own body aside) and fair-queueing tags (~160 B)."""
        tags = sum(len(f) for f in self._finish)
        cap = sum(f.capacity for f in self._finish)
        return {"waiting": Bound(self.waiting, self.policy.max_queue, "requests", 400),
                "tenant_tags": Bound(tags, cap, "tenants", 160)}  # fmt: skip

    # -- inside ------------------------------------------------------------------------

    def _ahead_of(self, t: Ticket) -> int:
        """Waiters that would go before ``t``: every one of a more urgent priority, and
        those of its own whose fair-queueing tag is no later than ``t``'s would be."""
        level = t.priority
        ahead = sum(self._waiting[:level])
        if self._waiting[level]:
            tag = max(self._vtime[level], self._finish[level].get(t.tenant) or 0.0)
            ahead += sum(1 for x in self._heaps[level] if x.state == "waiting" and x._tag <= tag)
        return ahead

    def _wait(self, t: Ticket, predicted: float | None) -> Verdict:
        if self.waiting >= self.policy.max_queue:
            return self._shed(t, QUEUE_FULL, self.expected_wait_s(self.waiting), predicted)
        self._enqueue(t)
        return Verdict("wait", predicted_ttft_s=predicted)

    @staticmethod
    def _fits(offer: Offer, slo: float | None) -> bool:
        predicted = offer.predicted_ttft_s
        return slo is None or predicted is None or predicted <= slo

    def _shed(
        self, t: Ticket, reason: str, wait_s: float, predicted: float | None = None
    ) -> Verdict:
        t.state = "shed"
        retry = min(self.policy.max_retry_after_s, max(1, math.ceil(wait_s)))
        return Verdict("shed", reason, retry, predicted)

    def _enqueue(self, t: Ticket) -> None:
        level = t.priority
        finish = self._finish[level]
        start = max(self._vtime[level], finish.get(t.tenant) or 0.0)
        finish.put(t.tenant, start + 1.0 / t.weight)
        self._seq += 1
        t._tag, t._seq = start, self._seq
        t.state = "waiting"
        heapq.heappush(self._heaps[level], t)
        self._waiting[level] += 1

    def _head(self) -> Ticket | None:
        for heap in self._heaps:
            while heap and heap[0].state != "waiting":
                heapq.heappop(heap)  # cancelled or timed out: removed lazily
            if heap:
                return heap[0]
        return None

    def _pop(self, t: Ticket) -> None:
        """Take ``t`` out of the waiting count; it leaves its heap now or lazily (a heap
        holding more dead entries than live ones is rebuilt, so it stays bounded)."""
        level = t.priority
        self._waiting[level] -= 1
        t.state = "dispatched"
        heap = self._heaps[level]
        if heap and heap[0] is t:
            heapq.heappop(heap)
        elif len(heap) > 2 * self._waiting[level] + 64:
            live = [x for x in heap if x.state == "waiting" and x is not t]
            heapq.heapify(live)
            self._heaps[level] = live
