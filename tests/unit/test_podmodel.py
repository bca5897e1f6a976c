"""The pure pod model shared by the live simulated pod and the discrete-event simulator."""

import random

import pytest

from bench.podmodel import MemoryL2, PodTiming, TieredCache, TierHit, TierTiming

BS = 4


def timing(**kw) -> PodTiming:
    base = dict(
        overhead_s=0.1,
        prefill_tokens_per_s=100.0,
        kv_bytes_per_token=1000,
        l1=TierTiming(0.01, 1e6),
        l2=TierTiming(0.05, 1e5),
        itl_base_s=0.02,
        itl_per_seq_s=0.005,
    )
    return PodTiming(**{**base, **kw})


def test_plan_charges_alpha_uncached_prefill_and_each_tier_load():
    plan = timing().plan(41, TierHit(l0=2, l1=3, l2=4), BS)
    assert (plan.l0_tokens, plan.l1_tokens, plan.l2_tokens) == (8, 12, 16)
    assert plan.cached_tokens == 36 and plan.external_tokens == 28
    assert plan.load_s == pytest.approx((0.01 + 12 * 1000 / 1e6) + (0.05 + 16 * 1000 / 1e5))
    assert plan.compute_s == pytest.approx(0.1 + 5 / 100)
    assert plan.ttft_s == pytest.approx(plan.load_s + plan.compute_s)


def test_a_prefill_behind_cached_tokens_pays_for_each_of_them_wherever_they_came_from():
    t = timing(prefill_s_per_cached_token=0.001)
    plan = t.plan(41, TierHit(l0=2, l1=3, l2=4), BS)  # 36 cached: 8 in L0, 28 loaded
    assert plan.compute_s == pytest.approx(0.1 + 5 / 100 + 36 * 0.001)
    assert t.lane_s(5, 0, False, random.Random(0), 36) == pytest.approx(plan.compute_s)
    curve = timing(prefill_curve=((1, 0.03), (10, 0.04)), prefill_s_per_cached_token=0.001)
    assert curve.compute_s(10, 100) == pytest.approx(0.04 + 0.1)
    assert timing().plan(41, TierHit(l0=2), BS).compute_s == pytest.approx(0.1 + 33 / 100)
    with pytest.raises(ValueError):
        timing(prefill_s_per_cached_token=-1e-6)


def test_a_tier_with_no_tokens_costs_nothing_not_even_its_latency():
    assert timing().load_s(0, 0) == 0.0


def test_inter_token_latency_grows_with_running_requests():
    t = timing()
    assert [t.itl_s(n) for n in (1, 2, 10)] == pytest.approx([0.025, 0.03, 0.07])


def test_negative_timings_are_rejected():
    with pytest.raises(ValueError):
        timing(itl_per_seq_s=-1)


def test_lookup_continues_l0_prefix_in_l1_then_l2_and_caps_at_last_token():
    l2 = MemoryL2(100)
    cache = TieredCache(l0_capacity=8, l1_capacity=8, l2=l2, name="a")
    cache.l0.insert(["k0"])
    cache.l1.put(["k1", "k2"])
    l2.put(["k0", "k1", "k2", "k3", "k4", "k5"], "b")
    keys = ["k0", "k1", "k2", "k3", "k4", "k5"]
    assert cache.lookup(keys, prompt_tokens=6 * BS + 1, block_size=BS) == TierHit(1, 2, 3)
    # A block-aligned prompt recomputes its last block: the hit stops one short.
    assert cache.lookup(keys, prompt_tokens=6 * BS, block_size=BS) == TierHit(1, 2, 2)


def test_admit_promotes_loaded_blocks_into_l0_and_writes_through_to_l1():
    cache = TieredCache(l0_capacity=8, l1_capacity=8, l1_policy="write-through")
    done = cache.admit(["a", "b", "c"], TierHit())
    assert (done.l0.stored, done.l0.held) == (["a", "b", "c"], 3)
    assert sorted(done.l1.stored) == ["a", "b", "c"]
    assert cache.lookup(["a", "b", "c"], 13, BS) == TierHit(3, 0, 0)


def test_evict_policy_offloads_exactly_what_l0_evicts():
    cache = TieredCache(l0_capacity=2, l1_capacity=8, l1_policy="evict")
    cache.admit(["a", "b"], TierHit())
    done = cache.admit(["x", "y"], TierHit())
    assert done.l0.evicted == ["b", "a"]  # a chain's tail goes first, like vLLM
    assert done.l1.stored == ["b", "a"]
    assert cache.lookup(["a", "b"], 9, BS) == TierHit(0, 2, 0)


def test_l1_evictions_are_reported_and_never_also_reported_as_stored():
    cache = TieredCache(l0_capacity=1, l1_capacity=1, l1_policy="evict")
    cache.admit(["a"], TierHit())
    cache.admit(["b"], TierHit())  # a -> L1
    done = cache.admit(["c"], TierHit())  # b -> L1 evicts a
    assert (done.l1.stored, done.l1.evicted) == (["b"], ["a"])


def test_l2_is_shared_between_pods_and_records_its_writer():
    l2 = MemoryL2(10)
    a = TieredCache(4, l2=l2, name="pod-a")
    b = TieredCache(4, l2=l2, name="pod-b")
    assert a.write_l2(["k0", "k1"]).stored == ["k0", "k1"]
    assert b.lookup(["k0", "k1"], 2 * BS + 1, BS) == TierHit(0, 0, 2)
    assert (l2.writer("k0"), len(l2)) == ("pod-a", 2)
    assert b.write_l2(["k0", "k1"]).stored == []  # already there: only touched


def test_l2_capacity_evicts_least_recently_used_files():
    l2 = MemoryL2(2)
    l2.put(["a", "b"], "p")
    l2.touch(["a"])
    result = l2.put(["c"], "p")
    assert (result.stored, result.evicted) == (["c"], ["b"])


def test_reset_clears_l0_and_l1_but_not_the_shared_l2():
    l2 = MemoryL2(10)
    cache = TieredCache(4, 4, l2=l2)
    cache.admit(["a"], TierHit())
    cache.write_l2(["a"])
    assert cache.clear() == 2
    assert cache.lookup(["a"], BS + 1, BS) == TierHit(0, 0, 1)


def test_unknown_l1_policy_is_rejected():
    with pytest.raises(ValueError):
        TieredCache(4, 4, l1_policy="sometimes")


def test_a_measured_prefill_curve_is_interpolated_and_its_end_segments_extended():
    t = timing(prefill_curve=((100, 0.02), (500, 0.04), (1000, 0.14)))
    assert t.compute_s(100) == pytest.approx(0.02)
    assert t.compute_s(300) == pytest.approx(0.03)  # halfway between the first two
    assert t.compute_s(750) == pytest.approx(0.09)
    assert t.compute_s(1500) == pytest.approx(0.24)  # the last segment's slope, extended
    assert t.compute_s(0) == pytest.approx(0.015)  # the first segment's, down to no tokens
    # The curve replaces overhead + tokens / rate (0.1 + 3 s here) in every plan.
    assert t.plan(300, TierHit(), BS).compute_s == pytest.approx(0.03)


def test_a_curve_extended_below_zero_is_floored_and_a_bad_curve_refused():
    steep = timing(prefill_curve=((100, 0.001), (200, 0.101)))
    assert steep.compute_s(0) == 0.0  # the line would say -0.099 s
    with pytest.raises(ValueError):
        timing(prefill_curve=((100, 0.02),))  # one point is no curve
    with pytest.raises(ValueError):
        timing(prefill_curve=((500, 0.02), (100, 0.04)))  # tokens must increase
    with pytest.raises(ValueError):
        timing(prefill_s_per_running=-0.001)


def test_each_other_request_holding_a_slot_adds_its_share_to_a_prefill():
    t = timing(prefill_s_per_running=0.005)
    assert [t.beside_running_s(n) for n in (-1, 0, 1, 4)] == pytest.approx([0, 0, 0.005, 0.02])
    assert timing().beside_running_s(4) == 0.0  # not set: a GPU's, where it is ~0


def test_a_prefill_queued_behind_another_pays_the_measured_share_of_the_fixed_part():
    """vLLM puts prefills that arrive together into one step: the second pays its tokens
    and only a share of the fixed cost (``kvgate bench calibrate``'s burst)."""
    rng = random.Random(0)
    t = timing(queued_overhead_share=0.25)  # 0.1 s fixed + 100 tokens/s
    assert t.lane_s(10, 0, False, rng) == pytest.approx(0.1 + 0.1)
    assert t.lane_s(10, 0, True, rng) == pytest.approx(0.025 + 0.1)
    curve = timing(prefill_curve=((100, 0.03), (200, 0.04)), queued_overhead_share=0.5)
    assert curve.lane_s(100, 0, True, rng) == pytest.approx(0.03 - 0.5 * 0.02)
    assert timing().lane_s(10, 0, True, rng) == pytest.approx(0.2)  # default: no sharing


def test_the_step_phase_wait_only_applies_beside_running_requests_and_not_after_a_queue():
    t = timing(step_phase_wait=True, prefill_s_per_running=0.01)
    rng = random.Random(0)
    assert t.lane_s(10, 0, False, rng) == pytest.approx(0.2)  # an idle engine starts now
    assert t.lane_s(10, 2, True, rng) == pytest.approx(0.2 + 0.02)  # at a step's end
    waits = [t.lane_s(10, 2, False, rng) - 0.22 for _ in range(200)]
    assert 0 <= min(waits) < 0.01 and t.itl_s(3) - 0.01 < max(waits) <= t.itl_s(3)
    assert timing().lane_s(10, 2, False, rng) == pytest.approx(0.2)  # off: no wait
