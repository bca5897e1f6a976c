"""kvgate bench calibrate against a simulated pod whose prefill speed is known."""

import pytest

from bench.calibrate import measure_prefill
from bench.sim.launch import start_sim_pods


@pytest.fixture
def pod():
    # 20 ms + 100 µs a token: slow enough that HTTP time on a busy machine is noise.
    (p,) = start_sim_pods(1, overhead_s=0.02, prefill_tokens_per_s=10_000.0)
    try:
        yield p
    finally:
        p.stop()


def test_the_fit_recovers_the_pods_overhead_and_per_token_cost(pod):
    fit = measure_prefill(pod.url, lengths=(128, 512, 1024, 2048), repeats=1)
    assert [n for n, _ in fit.points][0] > 128  # the pod's count: the chat template's tokens too
    assert 1e6 / fit.tokens_per_s == pytest.approx(100, rel=0.25)  # µs per token
    assert fit.overhead_s == pytest.approx(0.02, abs=0.015)
