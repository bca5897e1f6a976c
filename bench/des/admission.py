"""Admission control in simulated time: ``routing.admission`` driven by DES events.

The gateway's driver (``gateway.admission``) in the simulator's terms: a request that
must wait is a ticket in the model's ``AdmissionQueue``; its ``max_wait_s`` is a timed
event; a request leaving its pod's prefill or its pod altogether is the event that
drains the queue. The probe is the gateway's: the pods with room under the limits
(all of them if none is), the strategy's decision among them (``RoutingCore.decide``,
committed only if the request may go), and whether that pod holds none of ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bench.des.types import DesRequest
from routing.admission import AdmissionPolicy, AdmissionQueue, Offer, Ticket, Verdict
from routing.core import IndexAnswer
from routing.types import Decision, RouteRequest

if TYPE_CHECKING:
    from bench.des.sim import FleetSim


class DesAdmission:
    """One simulated gateway's admission control (the DES serves one model)."""

    def __init__(self, sim: FleetSim, policy: AdmissionPolicy) -> None:
        self.sim = sim
        self.queue = AdmissionQueue(policy)

    def arrive(
        self, index: int, req: DesRequest, route: RouteRequest, answer: IndexAnswer | None,
        now: float,
    ) -> None:  # fmt: skip
        t = Ticket(now, req.priority, req.tenant, slo_s=req.slo_s,
                   item=(index, req, route, answer))  # fmt: skip
        verdict = self.queue.arrive(t, now, self._probe)
        if verdict.kind == "dispatch":
            self._commit(t, verdict, now)
        elif verdict.kind == "shed":
            self.sim.shed(index, req, verdict.reason, now)
        else:
            self.sim._at(now + self.queue.policy.max_wait_s, self._timed_out, t)

    def load_changed(self, released: object, now: float) -> None:
        """A request's prefill ended (False) or it left its pod (True): waiters may go."""
        while (ready := self.queue.next_ready(now, self._probe)) is not None:
            self._commit(*ready, now)

    def _timed_out(self, t: object, now: float) -> None:
        assert isinstance(t, Ticket)
        verdict = self.queue.time_out(t)
        if verdict is not None:
            index, req, _, _ = t.item  # type: ignore[misc]
            self.sim.shed(index, req, verdict.reason, now)
            self.load_changed(False, now)  # the head may have changed

    def _probe(self, t: Ticket) -> Offer:
        _, _, route, answer = t.item  # type: ignore[misc]
        sim = self.sim
        candidates = sim._candidates(sim.now)
        load = sim.core.load
        policy = self.queue.policy
        free = [c for c in candidates if policy.has_room(load.get(c.pod))]
        decision = sim.core.decide(route, free or candidates, answer.match if answer else None)
        idle = load.get(decision.pod).in_flight == 0
        return Offer(bool(free), decision.predicted_ttft_s, idle, decision)

    def _commit(self, t: Ticket, verdict: Verdict, now: float) -> None:
        index, req, route, answer = t.item  # type: ignore[misc]
        assert isinstance(verdict.decision, Decision)
        routed = self.sim.core.commit(route, verdict.decision, answer.match if answer else None)
        routed.waited_s = now - t.arrived
        self.sim.submit(index, req, routed, now)
