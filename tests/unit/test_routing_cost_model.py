"""CostModel: defaults reproduce the original deployment; config overrides; tier rules."""

import math

import pytest

from kvindex.types import Tier
from routing.cost_model import CostModel, TierCost, as_cost_model, fit_original_deployment
from routing.types import PodView

IDLE = PodView("p")


def test_defaults_reproduce_the_published_points():
    m = CostModel()
    assert m.kv_bytes_per_token == 57_344  # 56 KiB per token, Qwen2-7B fp16
    # 1,925 tokens over L2's bandwidth take 56 ms (plus the fixed hit-path latency).
    assert m.load_s(Tier.L2, 1925) - m.l2.latency_s == pytest.approx(0.056)
    # 2,500 tokens: cold 774 ms, full L2 hit 287 ms (one recomputed token aside).
    assert m.predict_ttft_s(IDLE, 0, 0, 0, 2500) == pytest.approx(0.774)
    assert m.predict_ttft_s(IDLE, 0, 0, 2500, 2501) == pytest.approx(0.287 + 1 / 3653, abs=1e-4)
    # 500 tokens: the L2 hit is 0.99x as fast as recompute.
    cold = m.predict_ttft_s(IDLE, 0, 0, 0, 500)
    hit = m.prefill_overhead_s + m.load_s(Tier.L2, 500)
    assert cold / hit == pytest.approx(0.99)


def test_fitted_parameters_match_the_arithmetic_in_the_docstring():
    fit = fit_original_deployment()
    assert 1 / fit.prefill_s_per_token == pytest.approx(3653, abs=1)
    assert fit.prefill_overhead_s == pytest.approx(0.0897, abs=1e-4)
    assert fit.l2_latency_s == pytest.approx(0.1246, abs=1e-4)
    assert fit.l2_bandwidth_bytes_per_s == pytest.approx(1.971e9, rel=1e-3)


def test_an_l2_only_load_is_not_worth_it_below_about_1k_tokens():
    m = CostModel()
    assert m.break_even_tokens(Tier.L2) == pytest.approx(1156, abs=1)
    assert not m.worth_loading(Tier.L2, 500)
    assert not m.worth_loading(Tier.L2, 1000)
    assert m.worth_loading(Tier.L2, 1200)
    assert m.worth_loading(Tier.L2, 2500)
    # L1 (host DRAM over PCIe) pays for itself from a handful of tokens.
    assert m.worth_loading(Tier.L1, 16)
    assert not m.worth_loading(Tier.L1, 0)


def test_without_the_margin_l2_breaks_even_where_the_500_token_measurement_says():
    m = CostModel.from_dict({"l2": {"min_speedup": 1.0}})
    assert m.break_even_tokens(Tier.L2) == pytest.approx(509, abs=1)


def test_plan_loads_drops_a_segment_that_recomputes_faster():
    m = CostModel()
    assert m.plan_loads(l1_tokens=512, l2_tokens=2000) == (512, 2000)
    assert m.plan_loads(l1_tokens=512, l2_tokens=300) == (512, 0)  # 300 L2 tokens: recompute
    assert m.plan_loads(l1_tokens=0, l2_tokens=900) == (0, 0)
    assert m.plan_loads(l1_tokens=0, l2_tokens=0) == (0, 0)


def test_plan_loads_lets_l2_serve_the_l1_segment_when_l1_alone_is_not_worth_it():
    slow_l1 = CostModel.from_dict({"l1": {"latency_s": 1.0}})
    assert slow_l1.plan_loads(l1_tokens=400, l2_tokens=2000) == (0, 2400)


def test_queue_delay_counts_dispatched_prefill_foreign_waiting_and_running():
    m = CostModel.from_dict(
        {
            "prefill_tokens_per_s": 1000.0,
            "prefill_overhead_s": 0.1,
            "decode_s_per_running": 0.01,
            "waiting_prompt_tokens": 500,
        }
    )
    assert m.queue_delay_s(PodView("p")) == 0.0
    # 2,000 uncached tokens dispatched by us (2 s) + 3 running (30 ms).
    assert m.queue_delay_s(
        PodView("p", in_flight=2, in_flight_prefill_tokens=2000, running=3)
    ) == pytest.approx(2.03)
    # 5 waiting, 2 of them ours: 3 foreign x (0.1 + 0.5 s) + max(running, in_flight) x 10 ms.
    assert m.queue_delay_s(PodView("p", in_flight=2, waiting=5)) == pytest.approx(1.82)


def test_predict_ttft_always_recomputes_at_least_one_token():
    m = CostModel.from_dict({"prefill_tokens_per_s": 1000.0, "prefill_overhead_s": 0.0})
    assert m.predict_ttft_s(IDLE, 100, 0, 0, 100) == pytest.approx(0.001)


def test_a_prefill_behind_cached_tokens_pays_for_reading_their_keys():
    m = CostModel.from_dict(
        {"prefill_tokens_per_s": 1000.0, "prefill_overhead_s": 0.0,
         "prefill_s_per_cached_token": 0.0002}
    )  # fmt: skip
    # 100 new tokens behind 3,000 cached (L0 and L1 alike): 0.1 s + 3,000 x 0.2 ms.
    l1_load = m.load_s(Tier.L1, 1000)
    assert m.predict_ttft_s(IDLE, 2000, 1000, 0, 3100) == pytest.approx(0.1 + 0.6 + l1_load)
    # A full hit still recomputes its last token, and reads the keys of the rest.
    assert m.predict_ttft_s(IDLE, 3100, 0, 0, 3100) == pytest.approx(0.001 + 3099 * 0.0002)
    assert m.predict_ttft_s(IDLE, 0, 0, 0, 3100) == pytest.approx(3.1)  # nothing cached
    assert CostModel().prefill_s_per_cached_token == 0.0  # the defaults charge nothing


def test_fill_s_is_the_loads_plus_per_token_prefill_without_the_fixed_overhead():
    m = CostModel()
    assert m.fill_s(0, 0, 0) == 0.0
    assert m.fill_s(0, 0, 3653) == pytest.approx(1.0, rel=1e-3)  # 3,653 tokens/s
    assert m.fill_s(100, 2000, 10) == pytest.approx(
        m.load_s(Tier.L1, 100) + m.load_s(Tier.L2, 2000) + 10 / 3653, rel=1e-3
    )


def test_from_dict_overlays_nested_tiers_and_keeps_the_rest():
    m = CostModel.from_dict({"kv_bytes_per_token": 1024, "l2": {"latency_s": 0.5}})
    assert m.kv_bytes_per_token == 1024
    assert m.l2 == TierCost(CostModel().l2.bandwidth_bytes_per_s, 0.5, 2.0)
    assert m.l1 == CostModel().l1
    assert CostModel.from_dict(m.to_dict()) == m
    assert as_cost_model(None) == CostModel()
    assert as_cost_model(m) is m


@pytest.mark.parametrize(
    "bad",
    [
        {"prefill_token_per_s": 1.0},  # typo
        {"l2": {"bandwidth": 1.0}},
        {"l2": 3},
        {"prefill_tokens_per_s": 0},
        {"l1": {"bandwidth_bytes_per_s": -1}},
        {"prefill_overhead_s": -0.1},
        {"prefill_s_per_cached_token": -1e-6},
    ],
)
def test_from_dict_rejects_typos_and_impossible_values(bad):
    with pytest.raises(ValueError):
        CostModel.from_dict(bad)


def test_a_tier_that_never_beats_recompute_has_infinite_break_even():
    m = CostModel.from_dict({"l2": {"bandwidth_bytes_per_s": 1e6}})
    assert math.isinf(m.break_even_tokens(Tier.L2))
    assert not m.worth_loading(Tier.L2, 100_000)


def test_each_request_still_in_prefill_adds_the_fixed_overhead_to_the_queue():
    from routing.types import PodView

    m = CostModel(prefill_overhead_s=0.05, prefill_tokens_per_s=1000.0, decode_s_per_running=0.0)
    idle = PodView("a")
    busy = PodView("b", in_flight=3, in_flight_prefill_tokens=300, prefilling=3)
    assert m.queue_delay_s(idle) == 0.0
    assert m.queue_delay_s(busy) == pytest.approx(0.3 + 3 * 0.05)
    batched = CostModel.from_dict({"queued_overhead_share": 0.0}, m)
    assert batched.queue_delay_s(busy) == pytest.approx(0.3)
