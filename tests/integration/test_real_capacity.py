"""`kvgate bench real`'s capacity probe (`poisson:N%` cells) against simulated pods whose
service time is known: one prefill at a time per pod, a fixed cost each."""

import pytest

from bench.real_fleet import (
    CAPACITY_USERS,
    Capacity,
    RealPlan,
    completed_rps,
    measure_capacity,
)
from bench.sim.launch import start_sim_pods


def _capacity(overhead_s: float, probes: int = 1) -> Capacity:
    # Prefill is almost all fixed cost (a 1,600-token miss adds 1.6 ms) and decoding
    # runs beside the prefill lane, so each pod completes ~1 / overhead_s requests a
    # second once its lane never idles.
    pods = start_sim_pods(2, overhead_s=overhead_s, prefill_tokens_per_s=1_000_000.0)
    try:
        urls = [p.url for p in pods]
        return measure_capacity(RealPlan(pods=2), urls, urls, "users", probes)
    finally:
        for p in pods:
            p.stop()


def test_the_probe_measures_the_pods_service_rate():
    assert CAPACITY_USERS == 16  # every user of the users workload at once
    measured = _capacity(0.05, probes=3)
    assert len(measured.probes_rps) == 3
    assert measured.rps == sorted(measured.probes_rps)[1]  # their median
    fast, slow = measured.rps, _capacity(0.1).rps
    # Two lanes at 50 ms: 40 req/s at most; HTTP and the gateway take a little of it
    # (on a 2-core VM: 42.7 of 50 at 40 ms, 23.6 of 25 at 80 ms).
    assert 0.7 * 40 <= fast <= 1.05 * 40
    assert 0.7 * 20 <= slow <= 1.05 * 20
    assert fast / slow == pytest.approx(2.0, rel=0.2)


def test_completed_rps_counts_successes_from_first_sent_to_last_done():
    from bench.loadgen import RequestResult

    results = [
        RequestResult(0, True, sent_s=1.0, e2e_s=0.5),
        RequestResult(1, True, sent_s=1.2, e2e_s=1.8),  # done at 3.0
        RequestResult(2, False, sent_s=0.0, e2e_s=9.0),  # failed: neither counted nor timed
        RequestResult(3, True, sent_s=2.0, e2e_s=0.5),
    ]
    assert completed_rps(results) == (pytest.approx(1.5), 3, pytest.approx(2.0))
    assert completed_rps(results[:1]) == (0.0, 1, 0.0)
