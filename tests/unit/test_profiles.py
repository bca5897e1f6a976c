"""Hardware profiles: the original deployment's single-request sweep, reproduced.

Published points (routing/cost_model.py): at 2,500 tokens cold 774 ms vs L2 hit
287 ms (2.7x); at 500 tokens an L2 hit is no faster than recompute (0.99x);
1,925 tokens load from L2 in ~56 ms. Requests go through the same pure pod model
the simulators use: pod A computes the prompt and writes it to the shared L2,
pod B (cold L0/L1) then serves it from L2.
"""

import pytest

from bench.podmodel import MemoryL2, TieredCache
from bench.profiles import PROFILES, get_profile
from routing.cost_model import CostModel

BS = 16


def cross_pod_ttfts(profile_name: str, prompt_tokens: int) -> tuple[float, float]:
    """(cold TTFT on pod A, L2-hit TTFT on pod B) for one prompt, no queueing."""
    timing = get_profile(profile_name).timing
    l2 = MemoryL2(10_000)
    a = TieredCache(4096, 4096, l2=l2, name="a")
    b = TieredCache(4096, 4096, l2=l2, name="b")
    keys = list(range(prompt_tokens // BS))
    cold_hit = a.lookup(keys, prompt_tokens, BS)
    a.admit(keys, cold_hit)
    a.write_l2(keys)
    warm_hit = b.lookup(keys, prompt_tokens, BS)
    assert (warm_hit.l0, warm_hit.l1) == (0, 0) and warm_hit.l2 > 0
    return (
        timing.plan(prompt_tokens, cold_hit, BS).ttft_s,
        timing.plan(prompt_tokens, warm_hit, BS).ttft_s,
    )


def test_original_profile_reproduces_2_7x_l2_speedup_at_2500_tokens():
    cold, hit = cross_pod_ttfts("original", 2500)
    assert cold == pytest.approx(0.774, rel=0.01)
    assert hit == pytest.approx(0.287, rel=0.02)
    assert cold / hit == pytest.approx(2.7, rel=0.10)


def test_original_profile_l2_hit_is_no_faster_than_recompute_at_500_tokens():
    cold, hit = cross_pod_ttfts("original", 500)
    assert cold / hit == pytest.approx(0.99, rel=0.10)


def test_original_profile_loads_1925_tokens_from_l2_in_about_56_ms_of_transfer():
    timing = get_profile("original").timing
    transfer = timing.l2.load_s(1925, timing.kv_bytes_per_token) - timing.l2.latency_s
    assert transfer == pytest.approx(0.056, rel=0.01)
    assert timing.kv_bytes_per_token == 56 * 1024


def test_speedup_grows_with_prompt_length_in_the_original_sweep():
    speedups = [
        (lambda c, h: c / h)(*cross_pod_ttfts("original", n)) for n in (500, 1000, 1500, 2500)
    ]
    assert speedups == sorted(speedups)


def test_every_profile_cost_model_uses_the_profile_physics():
    for profile in PROFILES.values():
        cost = profile.cost_model(block_size=BS)
        t = profile.timing
        assert isinstance(cost, CostModel)
        assert cost.kv_bytes_per_token == t.kv_bytes_per_token
        assert cost.prefill_tokens_per_s == t.prefill_tokens_per_s
        assert cost.prefill_overhead_s == t.overhead_s
        assert cost.prefill_s_per_cached_token == t.prefill_s_per_cached_token
        assert profile.sim_settings(BS)["prefill_s_per_cached_token"] == (
            t.prefill_s_per_cached_token
        )
        assert (cost.l2.latency_s, cost.l2.bandwidth_bytes_per_s) == (
            t.l2.latency_s,
            t.l2.bandwidth_bytes_per_s,
        )
        assert cost.block_size == BS


def test_original_profile_cost_model_equals_the_routing_default():
    cost = get_profile("original").cost_model(block_size=16)
    assert cost == CostModel()


def test_llama8b_profiles_use_128_kib_per_token_and_the_h100_is_faster():
    l40s, h100 = get_profile("l40s-llama8b"), get_profile("h100-llama8b")
    assert l40s.timing.kv_bytes_per_token == h100.timing.kv_bytes_per_token == 128 * 1024
    assert h100.timing.prefill_tokens_per_s > l40s.timing.prefill_tokens_per_s
    assert h100.timing.itl_s(1) < l40s.timing.itl_s(1)


def test_sim_settings_convert_token_capacities_to_blocks():
    settings = get_profile("original").sim_settings(block_size=32)
    assert settings["l0_capacity_blocks"] == 110_000 // 32
    assert settings["itl_s"] == 0.025


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ValueError, match="original"):
        get_profile("a100")
