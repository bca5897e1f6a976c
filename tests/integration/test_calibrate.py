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


def test_requests_stream_on_the_pod_while_the_running_cost_is_measured(pod):
    import httpx

    from bench.calibrate import _streaming
    from bench.podstats import parse_metrics
    from bench.tinymodel import MODEL_NAME

    with _streaming(pod.url, MODEL_NAME, 2):
        metrics = parse_metrics(httpx.get(f"{pod.url}/metrics").text)
        assert metrics["vllm:num_requests_running"] == 2


def test_a_pod_whose_prefill_ignores_running_requests_measures_no_running_cost(pod):
    from bench.calibrate import measure_running

    # The simulated pod prefills in its own lane: decoding requests do not slow it.
    per_running, points = measure_running(pod.url, counts=(0, 2, 4), repeats=1)
    assert [k for k, _ in points] == [0, 2, 4]
    assert per_running < 0.005  # against 20 ms + 51 ms of prefill per point
    fit = measure_prefill(pod.url, lengths=(128, 512), repeats=1)
    assert "decode_s_per_running" not in fit.cost_model(16)  # only when measured


@pytest.mark.parametrize(("prefill_concurrency", "low", "high"), [(1, 0.7, 1.0), (0, 0.0, 0.3)])
def test_a_burst_of_cold_prompts_tells_whether_the_engine_prefills_them_together(
    prefill_concurrency, low, high
):
    from bench.calibrate import measure_burst

    (pod,) = start_sim_pods(1, overhead_s=0.02, prefill_tokens_per_s=10_000.0,
                            prefill_concurrency=prefill_concurrency)  # fmt: skip
    try:
        # The calibrator's own three bursts (their median): one burst alone, under the
        # full suite's load, once measured 0.39 on one lane (its first request late).
        share = measure_burst(pod.url, burst=4, repeats=3)
    finally:
        pod.stop()
    # One lane: the last of 4 starts after 3 whole prefills (share 1). Unlimited: all
    # start at once, the last is as quick as the first (0).
    assert low <= share <= high


@pytest.mark.parametrize("us_per_cached", [0.0, 40.0])
def test_the_cost_of_each_cached_token_is_measured_from_hits_behind_prefixes(us_per_cached):
    from bench.calibrate import measure_cached

    (pod,) = start_sim_pods(1, overhead_s=0.02, prefill_tokens_per_s=10_000.0,
                            prefill_s_per_cached_token=us_per_cached * 1e-6)  # fmt: skip
    try:
        per_cached, points = measure_cached(pod.url, cached=(64, 1024, 2048), repeats=1)
    finally:
        pod.stop()
    # x is what the pod served from its cache: whole 16-token blocks of each prefix.
    assert [c for c, _ in points] == sorted(c for c, _ in points)
    assert points[-1][0] >= 1900
    # 40 µs a cached token is 80 ms over 2,000 of them, against ~27 ms of the rest.
    assert per_cached * 1e6 == pytest.approx(us_per_cached, abs=8.0)


def test_cached_lengths_past_the_pods_context_are_left_out():
    from bench.calibrate import measure_cached

    (pod,) = start_sim_pods(1, overhead_s=0.005, prefill_tokens_per_s=50_000.0,
                            max_model_len=1100)  # fmt: skip
    try:
        _, points = measure_cached(pod.url, cached=(64, 512, 1024, 2048), repeats=1)
        with pytest.raises(ValueError, match="fewer than two"):
            measure_cached(pod.url, cached=(1024, 2048), repeats=1)
    finally:
        pod.stop()
    # 1,024 + the 64-token suffix + a margin of 64 for the template passes 1,100: left out.
    assert len(points) == 2 and points[-1][0] < 600


def test_the_decode_step_of_a_request_alone_is_measured_from_its_stream():
    (p,) = start_sim_pods(1, itl_s=0.02)
    try:
        from bench.calibrate import measure_decode

        step = measure_decode(p.url, tokens=17, repeats=2)
    finally:
        p.stop()
    assert step == pytest.approx(0.02, rel=0.3)
