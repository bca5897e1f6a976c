"""Admission control in the simulated fleet: under overload it keeps goodput and the
high-priority tenant's TTFT, and a modest tenant is not starved by a flooding one.

The fleet, prompts and setups are ``kvgate bench admission``'s, over 20 s of arrivals."""

from __future__ import annotations

import pytest

from bench.admission import FLOOD, Plan, Stream, requests, row, simulate
from bench.des.sim import FleetSim
from bench.des.types import DesRequest
from routing.admission import AdmissionPolicy

PLAN = Plan(seconds=20.0)
NONE, SHED, SHED_LIMITED, RR_NONE, RR_LIMITED = PLAN.setups()


@pytest.fixture(scope="module")
def overload() -> list[DesRequest]:
    return requests(PLAN, (Stream("all", 0, 1.0),), load=2.0)


@pytest.fixture(scope="module")
def flood() -> list[DesRequest]:
    return requests(PLAN, FLOOD)


def test_without_admission_overload_leaves_almost_no_request_within_its_slo(overload):
    without = row(PLAN, NONE.label, "2x", simulate(PLAN, NONE, overload))
    assert without.shed == 0 and without.served_in_slo < 0.05
    assert without.ttft_p50_ms > 5_000  # the pods' queues only grow


def test_admission_sheds_what_would_be_late_and_serves_the_rest_within_the_slo(overload):
    results = simulate(PLAN, SHED_LIMITED, overload)
    served = [r for r in results if not r.shed]
    admitted = row(PLAN, SHED_LIMITED.label, "2x", results)
    assert 0.3 < admitted.shed < 0.7
    assert sum(r.ttft_s <= PLAN.slo_s for r in served) / len(served) > 0.85
    assert admitted.goodput_rps > 0.8 * PLAN.capacity_rps()
    without = row(PLAN, NONE.label, "2x", simulate(PLAN, NONE, overload))
    assert admitted.goodput_rps > 10 * without.goodput_rps


def test_shed_requests_never_reach_a_pod_and_every_request_has_one_result(overload):
    results = simulate(PLAN, SHED_LIMITED, overload)
    assert [r.index for r in results] == list(range(len(overload)))
    shed = [r for r in results if r.shed]
    assert shed and {r.shed for r in shed} <= {"slo", "queue_full", "queue_timeout"}
    assert all(r.pod == "" and r.ttft_s == 0 for r in shed)
    assert all(r.pod and r.ttft_s > 0 for r in results if not r.shed)


def test_a_low_priority_flood_leaves_the_high_priority_tenant_within_its_slo(flood):
    def search(setup) -> float:
        results = simulate(PLAN, setup, flood)
        return row(PLAN, setup.label, "search", [r for r in results if r.tenant == "search"])

    assert search(NONE).ttft_p90_ms > 10_000
    protected = search(SHED_LIMITED)
    assert protected.ttft_p90_ms < PLAN.slo_s * 1000 and protected.served_in_slo > 0.8


def test_a_modest_tenant_keeps_its_share_while_another_of_its_priority_floods(flood):
    results = simulate(PLAN, SHED_LIMITED, flood)

    def within(tenant: str) -> float:
        return row(PLAN, "", tenant, [r for r in results if r.tenant == tenant]).served_in_slo

    assert within("etl") > 0.7 and within("batch") < 0.4


def test_admission_needs_an_open_loop_workload():
    sim = FleetSim(2, "round-robin", PLAN.spec(), admission=AdmissionPolicy())
    with pytest.raises(ValueError, match="open-loop"):
        sim.run_closed([[DesRequest(0.0, 32, 1, [])]], concurrency=1)
