"""KV-aware: minimum predicted TTFT from the index's tiers, the cost model and load."""

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvindex.types import PodPrefix, PrefixMatch
from routing.load import LoadTracker
from routing.strategies.kv_aware import KvAware, evicted_blocks
from routing.strategy_registry import build_strategy
from routing.types import Decision, Outcome, PodView, Reason, RouteRequest

# Round numbers so each expectation can be checked by hand:
# prefill 1 ms/token, no overhead; L1 0.01 ms/token + 1 ms; L2 0.1 ms/token + 50 ms.
SIMPLE = {
    "kv_bytes_per_token": 1000,
    "prefill_tokens_per_s": 1000.0,
    "prefill_overhead_s": 0.0,
    "l1": {"bandwidth_bytes_per_s": 1e8, "latency_s": 0.001, "min_speedup": 1.0},
    "l2": {"bandwidth_bytes_per_s": 1e7, "latency_s": 0.05, "min_speedup": 1.0},
    "decode_s_per_running": 0.0,
}
BS = 16


def _simple(**options):
    return KvAware(cost_model=SIMPLE, calibrate=False, **options)


def _match(prompt_tokens, l2=0, **pods):
    return PrefixMatch(total_blocks=prompt_tokens // BS, block_size=BS, pods=dict(pods), l2=l2)


def _req(prompt_tokens, model="m"):
    return RouteRequest(model=model, prompt_tokens=prompt_tokens)


def test_registry_accepts_hyperpod_and_short_names():
    for name in ("kv-aware", "kvaware", "kv", "precise", "KV_AWARE"):
        assert isinstance(build_strategy(name, {"cost_model": SIMPLE}), KvAware)


def test_a_long_l2_only_match_loses_to_a_short_l0_match_plus_load_when_cheaper():
    # Predicted TTFT alone (eviction_weight 0); the eviction cost is tested below.
    # 1,601 tokens; L2 holds 100 blocks (1,600 tokens) for everybody; "warm" holds 25 in L0.
    match = _match(1601, l2=100, warm=PodPrefix(l0=25, l0_l1=25))
    # cold: 50 + 160 (1,600 L2 tokens) + 1 (last token)             = 211 ms
    # warm: 30 queued + 50 + 120 (1,200 L2 tokens) + 1              = 201 ms
    pods = [PodView("cold"), PodView("warm", in_flight=1, in_flight_prefill_tokens=30)]
    d = _simple(eviction_weight=0).choose(_req(1601), pods, match, 0.0)
    assert (d.pod, d.reason) == ("warm", Reason.CACHE_HIT)
    assert (d.predicted_l0_tokens, d.predicted_l1_tokens, d.predicted_l2_tokens) == (400, 0, 1200)
    assert d.predicted_ttft_s == pytest.approx(0.201)
    assert d.scores == pytest.approx({"cold": 0.211, "warm": 0.201})
    # With 50 tokens queued the warm pod predicts 221 ms: the L2-only pod wins. Its
    # prefix (1,600 from L2) is as long as warm's, so this is a hit, not a spill.
    pods = [PodView("cold"), PodView("warm", in_flight=1, in_flight_prefill_tokens=50)]
    d = _simple(eviction_weight=0).choose(_req(1601), pods, match, 0.0)
    assert (d.pod, d.reason, d.predicted_l2_tokens) == ("cold", Reason.CACHE_HIT, 1600)


def test_a_full_l0_hit_behind_a_long_queue_loses_to_an_idle_pod():
    match = _match(1601, hot=PodPrefix(l0=100, l0_l1=100))
    idle = PodView("idle")
    # hot: 3,300 queued + 1 = 3,301 ms; idle: 1,601 ms of prefill, plus 1,600 ms for the
    # 1,600 tokens of other prefixes its L0 write evicts (eviction_weight 1).
    d = _simple().choose(_req(1601), [PodView("hot", 3, 3300), idle], match, 0.0)
    assert (d.pod, d.reason, d.predicted_cached_tokens) == ("idle", Reason.LOAD_SPILL, 0)
    assert d.predicted_ttft_s == pytest.approx(1.601)
    assert d.scores == pytest.approx({"hot": 3.301, "idle": 3.201})
    # 2,000 queued: hot predicts 2,001 ms, worse than idle's 1,601 ms, but keeps the
    # request: spilling would cost idle's cached prefixes more than it saves here.
    d = _simple().choose(_req(1601), [PodView("hot", 3, 2000), idle], match, 0.0)
    assert (d.pod, d.reason, d.predicted_l0_tokens) == ("hot", Reason.CACHE_HIT, 1600)
    assert d.predicted_ttft_s == pytest.approx(2.001)
    # Ranked by predicted TTFT alone, the same request spills.
    d = _simple(eviction_weight=0).choose(_req(1601), [PodView("hot", 3, 2000), idle], match, 0.0)
    assert (d.pod, d.reason, d.scores) == (
        "idle",
        Reason.LOAD_SPILL,
        pytest.approx({"hot": 2.001, "idle": 1.601}),
    )


def test_a_pod_with_l0_room_takes_a_copy_of_a_hot_prefix_for_its_prefill_alone():
    # The case above (hot: 2,001 ms behind its queue; idle: 1,601 ms of prefill plus
    # 1,600 ms of eviction). Idle's L0 holds 10,000 blocks; writes that keep it under a
    # quarter of that (2,500) evict nothing, so only the 100 blocks it writes beyond
    # that count.
    match = _match(1601, hot=PodPrefix(l0=100, l0_l1=100))
    hot = PodView("hot", 3, 2000)
    for held, idle_score in (
        (None, 3.201),  # occupancy unknown: a full cache
        (2500, 3.201),  # at a quarter: every block written evicts
        (2440, 1.601 + 0.640),  # 60 blocks of room: 40 of the 100 evict
        (2400, 1.601),
        (0, 1.601),
    ):
        idle = PodView("idle", kv_capacity_blocks=10_000, kv_held_blocks=held)
        d = _simple().choose(_req(1601), [hot, idle], match, 0.0)
        assert d.scores["idle"] == pytest.approx(idle_score), held
        assert d.pod == ("idle" if idle_score < 2.001 else "hot"), held
    # L0 size not scraped: a full cache too.
    idle = PodView("idle", kv_held_blocks=0)
    assert _simple().choose(_req(1601), [hot, idle], match, 0.0).pod == "hot"
    # roomy_share 1: all the free room counts; 0: none does.
    idle = PodView("idle", kv_capacity_blocks=10_000, kv_held_blocks=9_900)
    assert _simple(roomy_share=1.0).choose(_req(1601), [hot, idle], match, 0.0).pod == "idle"
    idle = PodView("idle", kv_capacity_blocks=10_000, kv_held_blocks=0)
    assert _simple(roomy_share=0.0).choose(_req(1601), [hot, idle], match, 0.0).pod == "hot"


def test_evicted_blocks_counts_copies_beyond_the_roomy_part_and_new_blocks_beyond_the_free():
    # Copies only: what does not fit under the roomy share evicts.
    assert evicted_blocks(100, 0, roomy_room=0, free_room=10**6) == 100
    assert evicted_blocks(100, 0, roomy_room=40, free_room=10**6) == 60
    assert evicted_blocks(100, 0, roomy_room=-3, free_room=10**6) == 100
    # New blocks only: what does not fit in all the free room evicts.
    assert evicted_blocks(0, 100, roomy_room=0, free_room=100) == 0
    assert evicted_blocks(0, 100, roomy_room=0, free_room=30) == 70
    assert evicted_blocks(0, 100, roomy_room=0, free_room=-5) == 100
    # Both: the copies are written first and take their share of the free room.
    assert evicted_blocks(40, 60, roomy_room=0, free_room=80) == 40 + 20
    assert evicted_blocks(40, 60, roomy_room=40, free_room=100) == 0
    assert evicted_blocks(0, 0, roomy_room=0, free_room=0) == 0


def test_a_new_prompt_goes_where_it_evicts_least_not_to_a_full_pod_a_little_less_queued():
    # 1,601 tokens held nowhere: 100 blocks to write on any pod. Both caches hold 10,000
    # blocks. "full" holds 9,944 and has 96 tokens (6 blocks) queued, so 50 blocks free;
    # "roomy" holds 5,000, far above a quarter, and has 300 tokens queued. Priced as
    # evicting everywhere (the copies' rule), the queue would decide: full, by 204 ms.
    # But there the write evicts 50 blocks of other prefixes (800 ms of their prefill),
    # on roomy none.
    match = _match(1601)
    full = PodView("full", 1, 96, kv_capacity_blocks=10_000, kv_held_blocks=9_944)
    roomy = PodView("roomy", 1, 300, kv_capacity_blocks=10_000, kv_held_blocks=5_000)
    d = _simple().choose(_req(1601), [full, roomy], match, 0.0)
    assert d.pod == "roomy"
    assert d.scores == pytest.approx({"full": 1.697 + 0.8, "roomy": 1.901})
    # What a pod's prefills in flight will write counts as taken: 5,000 blocks queued on
    # a pod holding 5,000 leave no room, so all 100 blocks evict (1.6 s of prefill).
    busy = PodView("busy", 1, 5_000 * BS, kv_capacity_blocks=10_000, kv_held_blocks=5_000)
    kv = _simple()
    assert kv.estimate(kv.default_cost, _req(1601), busy, match).eviction_s == pytest.approx(1.6)
    # A prefix another pod holds is a copy on these two: the roomy share rules, both are
    # above it, so both evict all 100 blocks and the queue decides.
    match = _match(1601, other=PodPrefix(l0=100, l0_l1=100))
    d = _simple().choose(_req(1601), [full, roomy], match, 0.0)
    assert d.pod == "full"
    assert d.scores == pytest.approx({"full": 1.697 + 1.6, "roomy": 1.901 + 1.6})


def test_evicting_what_l2_holds_costs_an_l2_load_so_spilling_stays_cheap():
    # The whole prompt is in L2 too: a pod without it loads it (0.05 + 0.16 s) instead of
    # recomputing, and what its write evicts is priced the same way.
    match = _match(1601, l2=100, hot=PodPrefix(l0=100, l0_l1=100))
    idle = PodView("idle")
    d = _simple().choose(_req(1601), [PodView("hot", 3, 500), idle], match, 0.0)
    assert (d.pod, d.reason, d.predicted_l2_tokens) == ("idle", Reason.CACHE_HIT, 1600)
    assert d.scores == pytest.approx({"hot": 0.501, "idle": 0.211 + 0.21})
    d = _simple().choose(_req(1601), [PodView("hot", 3, 400), idle], match, 0.0)
    assert (d.pod, d.predicted_l0_tokens) == ("hot", 1600)


def test_a_shorter_l0_prefix_pays_for_the_extra_blocks_it_would_write():
    # The L2 case above with warm 50 tokens queued: TTFT alone prefers cold (211 < 221 ms),
    # but cold writes 1,600 L2 tokens into L0 and warm 1,200: 210 vs 170 ms of evictions.
    match = _match(1601, l2=100, warm=PodPrefix(l0=25, l0_l1=25))
    pods = [PodView("cold"), PodView("warm", in_flight=1, in_flight_prefill_tokens=50)]
    d = _simple().choose(_req(1601), pods, match, 0.0)
    assert (d.pod, d.reason, d.predicted_ttft_s) == ("warm", Reason.CACHE_HIT, pytest.approx(0.221))
    assert d.scores == pytest.approx({"cold": 0.211 + 0.21, "warm": 0.221 + 0.17})


def test_a_short_prompt_held_only_in_l2_does_not_pull_traffic_to_a_busy_pod():
    kv = KvAware(calibrate=False)  # the original deployment's model: L2 pays from ~1.16k
    busy = PodView("busy", in_flight=2, in_flight_prefill_tokens=300)
    idle = PodView("idle")
    d = kv.choose(_req(900), [busy, idle], _match(900, l2=56), 0.0)
    assert (d.pod, d.reason, d.predicted_l2_tokens) == ("idle", Reason.LEAST_LOADED, 0)
    # The same shape at 2,500 tokens does count the L2 load (for every pod alike).
    d = kv.choose(_req(2500), [busy, idle], _match(2500, l2=156), 0.0)
    assert (d.pod, d.reason, d.predicted_l2_tokens) == ("idle", Reason.CACHE_HIT, 2496)


def test_a_short_l0_lead_over_l2_does_not_beat_an_idle_pod_under_1k_tokens():
    # busy holds 2 blocks in L0; the rest sits in L2, too short to be worth loading.
    kv = KvAware(calibrate=False)
    match = _match(900, l2=56, busy=PodPrefix(l0=2, l0_l1=2))
    busy = PodView("busy", in_flight=1, in_flight_prefill_tokens=200)
    d = kv.choose(_req(900), [busy, PodView("idle")], match, 0.0)
    assert (d.pod, d.reason) == ("idle", Reason.LOAD_SPILL)


def test_cached_tokens_are_capped_like_vllm_which_recomputes_the_last_token():
    match = _match(32, p=PodPrefix(l0=2, l0_l1=2))  # the whole 2-block prompt in L0
    d = _simple().choose(_req(32), [PodView("p")], match, 0.0)
    assert (d.predicted_l0_tokens, d.predicted_ttft_s) == (16, pytest.approx(0.016))
    assert d.speculate_blocks == 2


def test_l1_tokens_count_between_l0_and_l2():
    match = _match(3201, l2=200, p=PodPrefix(l0=50, l0_l1=150))
    d = _simple().choose(_req(3201), [PodView("p")], match, 0.0)
    assert (d.predicted_l0_tokens, d.predicted_l1_tokens, d.predicted_l2_tokens) == (
        800,
        1600,
        800,
    )
    # 1 ms + 16 ms (L1) + 50 + 80 ms (L2) + 1 ms (last token)
    assert d.predicted_ttft_s == pytest.approx(0.148)


def test_no_match_falls_back_to_the_least_queue():
    pods = [PodView("a", in_flight=1, in_flight_prefill_tokens=100), PodView("b")]
    d = _simple().choose(_req(500), pods, None, 0.0)
    assert (d.pod, d.reason, d.predicted_cached_tokens, d.speculate_blocks) == (
        "b",
        Reason.FALLBACK,
        0,
        0,
    )
    assert d.predicted_ttft_s == pytest.approx(0.5)


def test_prompt_length_defaults_to_the_matched_blocks():
    d = _simple().choose(_req(0), [PodView("a")], _match(320), 0.0)
    assert d.predicted_ttft_s == pytest.approx(0.320)


TIE_PODS = [
    PodView("d", in_flight=1),
    PodView("b", in_flight=1),
    PodView("a", in_flight=2),
    PodView("c", in_flight=1),
]


@given(st.permutations(TIE_PODS))
def test_ties_go_to_the_less_loaded_pod_then_the_smaller_id_in_any_order(pods):
    # Equal predicted TTFT everywhere (no decode share, no prefill queued).
    d = _simple().choose(_req(800), pods, _match(800), 0.0)
    assert d.pod == "b"


@given(st.permutations([PodView(p) for p in "edcba"]))
def test_ties_among_identical_pods_go_to_the_smallest_id(pods):
    assert _simple().choose(_req(800), pods, _match(800), 0.0).pod == "a"


def _burst(kv: KvAware, n: int = 32) -> list[str]:
    """``n`` identical 2,000-token requests, none finishing; load as the gateway counts it."""
    tracker = LoadTracker()
    held: dict[str, PodPrefix] = {}
    placed = []
    for _ in range(n):
        loads = {p: tracker.get(p) for p in "abcd"}
        pods = [PodView(p, x.in_flight, x.prefill_tokens, prefilling=x.prefilling)
                for p, x in loads.items()]  # fmt: skip
        d = kv.choose(_req(2000), pods, _match(2000, **held), 0.0)
        tracker.start(d.pod, 2000 - d.predicted_cached_tokens)
        held[d.pod] = PodPrefix(l0=d.speculate_blocks, l0_l1=d.speculate_blocks)  # speculation
        placed.append(d.pod)
    return placed


def test_a_burst_of_identical_requests_spreads_when_load_is_counted_at_dispatch():
    # Default model: a hit costs ~95 ms of prefill, a copy elsewhere ~637 ms plus ~543 ms
    # of evictions, so the burst stays on "a" for 6 requests, then fills the others alike.
    placed = _burst(KvAware(calibrate=False))
    assert "".join(placed[:24]) == "aaaaaabbbbbbccccccdddddd"
    assert Counter(placed) == {"a": 8, "b": 8, "c": 8, "d": 8}
    # Ranked by predicted TTFT alone, the copies are made at once.
    placed = _burst(KvAware(calibrate=False, eviction_weight=0))
    assert placed[:4] == ["a", "b", "c", "d"]
    assert Counter(placed) == {"a": 8, "b": 8, "c": 8, "d": 8}


def test_observe_calibrates_the_requests_model_only():
    kv = KvAware(cost_model=SIMPLE, calibration={"min_samples": 4, "refit_every": 1})
    for prompt in (1000, 2000, 3000, 4000):
        req = _req(prompt, model="slow")
        d = kv.choose(req, [PodView("a")], _match(prompt), 0.0)
        kv.observe(req, d, Outcome(ok=True, ttft_s=prompt * 0.002, prompt_tokens=prompt))
    assert kv.cost_model("slow").prefill_tokens_per_s == pytest.approx(500.0)
    assert kv.cost_model("other").prefill_tokens_per_s == 1000.0


def test_failed_requests_do_not_calibrate():
    kv = KvAware(cost_model=SIMPLE, calibration={"min_samples": 2, "refit_every": 1})
    d = Decision(pod="a", strategy="kv-aware", reason=Reason.FALLBACK)
    for prompt in (1000, 2000, 3000):
        kv.observe(_req(prompt), d, Outcome(ok=False, ttft_s=9.0, prompt_tokens=prompt))
    assert kv.calibrator("m").samples == 0


def test_per_model_cost_models_overlay_the_default():
    kv = KvAware(cost_model=SIMPLE, models={"big": {"prefill_tokens_per_s": 100.0}})
    assert kv.cost_model("big").prefill_tokens_per_s == 100.0
    assert kv.cost_model("big").kv_bytes_per_token == 1000
    assert kv.cost_model("small").prefill_tokens_per_s == 1000.0


def test_bad_options_fail_at_construction():
    with pytest.raises(ValueError):
        KvAware(cost_model={"no_such_knob": 1})
    with pytest.raises(ValueError):
        KvAware(eviction_weight=-1)
    for share in (-0.1, 1.5):
        with pytest.raises(ValueError):
            KvAware(roomy_share=share)
    with pytest.raises(TypeError):
        KvAware(calibration={"windw": 3})


def test_observe_fits_the_cost_of_each_request_running_on_the_pod():
    kv = KvAware(cost_model=SIMPLE, calibration={"min_samples": 8, "refit_every": 1})
    for i in range(24):
        prompt, running = 1000 + 100 * (i % 5), i % 6
        req = _req(prompt)
        pod = PodView("a", in_flight=running)
        d = kv.choose(req, [pod], _match(prompt), 0.0)
        assert d.predicted_running == running
        ttft = prompt * 0.001 + running * 0.005  # the pod: 1 ms/token, 5 ms per running
        kv.observe(req, d, Outcome(ok=True, ttft_s=ttft, prompt_tokens=prompt))
    assert kv.cost_model("m").decode_s_per_running == pytest.approx(0.005, rel=0.05)


def test_kv_aware_learns_at_the_first_token_with_the_cached_tokens_it_predicted():
    # At the first token the engine has not reported its cached count yet: a point of
    # 512 cached tokens out of 1,000 must be fitted as 488 computed, not 1,000.
    kv = KvAware(cost_model=SIMPLE, calibration={"min_samples": 2, "refit_every": 1})
    assert kv.learns_at_first_token
    req = _req(1000)
    d = kv.choose(req, [PodView("a")], _match(1000, a=PodPrefix(l0=32)), 0.0)
    assert d.predicted_l0_tokens == 512
    kv.observe(req, d, Outcome(ok=True, ttft_s=0.488))
    assert kv.calibrator("m").last_point == (488, 0, pytest.approx(0.488))
    assert not KvAware(cost_model=SIMPLE, learn_at_first_token=False).learns_at_first_token
    assert not KvAware(cost_model=SIMPLE, calibrate=False).learns_at_first_token


def test_kv_aware_revises_a_first_token_point_the_engines_cached_count_contradicts():
    # The index said 512 of 1,000 tokens were cached on pod a, the engine at the end 0
    # (an eviction the index had not heard of): the 1.0 s prefill must be learnt as
    # 1,000 computed tokens, not 488, and pod a's ratio from the same split.
    kv = KvAware(cost_model=SIMPLE, calibration={"min_samples": 2, "refit_every": 1})
    req = _req(1000)
    d = kv.choose(req, [PodView("a")], _match(1000, a=PodPrefix(l0=32)), 0.0)
    learnt = kv.observe(req, d, Outcome(ok=True, ttft_s=1.0))
    assert kv.calibrator("m").last_point == (488, 0, pytest.approx(1.0))
    kv.revise(req, d, learnt, Outcome(ok=True, ttft_s=1.0, prompt_tokens=1000, cached_tokens=0))
    assert kv.calibrator("m").samples == 1
    assert kv.calibrator("m").last_point == (1000, 0, pytest.approx(1.0))
    assert kv.speeds is not None
    for _ in range(7):  # seven more at the model's speed: pod a is the average, exactly
        kv.observe(req, d, Outcome(ok=True, ttft_s=1.0, prompt_tokens=1000, cached_tokens=0))
    assert kv.calibrator("m").current().prefill_tokens_per_s == pytest.approx(1000.0)


def test_a_pods_prompt_counts_far_from_the_gateways_do_not_calibrate():
    # The gateway tokenized these prompts (block keys): one pod reporting 1,000x their
    # length must not refit the cost model every pod of the model is routed on.
    kv = KvAware(cost_model=SIMPLE, calibration={"min_samples": 2, "refit_every": 1})
    for prompt in (1000, 2000, 3000):
        req = RouteRequest(model="m", prompt_tokens=prompt, block_keys=list(range(prompt // 16)))
        d = kv.choose(req, [PodView("a")], _match(prompt), 0.0)
        kv.observe(req, d, Outcome(ok=True, ttft_s=prompt * 0.001, prompt_tokens=prompt * 1000))
    assert kv.calibrator("m").samples == 0
    req = RouteRequest(model="m", prompt_tokens=1000, block_keys=list(range(62)))
    d = kv.choose(req, [PodView("a")], _match(1000), 0.0)
    kv.observe(req, d, Outcome(ok=True, ttft_s=1.0, prompt_tokens=1003))  # a few apart: learnt
    assert kv.calibrator("m").samples == 1
