"""``kvgate bench des --real-cells``: the real-fleet benchmark's cells on simulated pods
timed by the fit ``kvgate bench real`` measured."""

from __future__ import annotations

import argparse
import json
import statistics

import pytest

from bench.calibrate import PrefillFit
from bench.des import cli, real_cells


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_des_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_fit_of_a_real_run_times_the_pods_and_configures_kv_aware(tmp_path):
    points = [[139, 0.024], [523, 0.035], [1035, 0.060], [2059, 0.169]]
    fit = {"overhead_s": 0.0, "tokens_per_s": 20_000.0, "s_per_running": 0.003,
           "queued_overhead_share": 0.25, "points": points}  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"fit": fit, "cells": []}))
    loaded = real_cells.load_fit(path)
    # A measured 0 ms overhead is the run's, not a gap for the default to fill.
    assert (loaded.overhead_s, loaded.tokens_per_s, loaded.s_per_running,
            loaded.queued_overhead_share) == (0.0, 20_000.0, 0.003, 0.25)  # fmt: skip
    spec = real_cells.real_pod_spec(loaded)
    # The pods prefill along the measured points, not the line kv-aware is given ...
    assert spec.timing.compute_s(523) == pytest.approx(0.035)
    assert spec.timing.compute_s(779) == pytest.approx((0.035 + 0.060) / 2)
    assert spec.timing.compute_s(139) > 2 * (139 / 20_000)
    # ... with the running requests' share and the step phase of a real engine.
    assert spec.timing.beside_running_s(2) == pytest.approx(0.006)
    assert spec.timing.step_phase_wait
    # A fit from before the decode step was measured decodes a step of the running cost.
    assert loaded.decode_step_s is None and spec.timing.itl_s(1) == pytest.approx(0.003)
    assert spec.timing.decode_waits_for_prefill  # the engine's step carries a prefill
    assert (spec.block_size, spec.prefill_concurrency) == (32, 1)
    expected = PrefillFit(0.0, 20_000.0, (), 0.003, (), 0.25).cost_model(32)
    assert real_cells.kv_aware_options(loaded) == {"cost_model": expected}
    assert real_cells.load_fit(None) == real_cells.DEFAULT_FIT


def test_a_cell_gets_the_prompts_and_arrivals_of_the_real_run():
    closed = real_cells.cell_input("chat@closed:4", 0, "kv-aware")
    assert (closed.concurrency, closed.size) == (4, 72)  # 24 users, 3 turns each
    one = real_cells.cell_input("users@poisson:24", 0, "kv-aware")
    again = real_cells.cell_input("users@poisson:24", 0, "kv-aware")
    other = real_cells.cell_input("users@poisson:24", 0, "round-robin")
    assert (one.concurrency, one.size) == (None, 96)
    assert [r.block_keys for r in one.requests] == [r.block_keys for r in again.requests]
    # Fresh prompts per router, the same arrivals.
    assert [r.block_keys for r in one.requests] != [r.block_keys for r in other.requests]
    assert [r.arrival_s for r in one.requests] == [r.arrival_s for r in other.requests]


def test_kv_aware_spreads_the_users_cell_like_round_robin_once_pods_have_room(capsys):
    """The real users cell near capacity: one shared system prompt, a context per user.
    Each fresh pod is empty, so copying a prompt there costs its prefill only; kv-aware
    (which priced a pod it had no events from as a full cache: p90 71 ms against
    round-robin's 38 over 8 seeds) now spreads and ties round-robin."""
    args = _args("--real-cells", "users@poisson:24", "--seeds", "0,1,2",
                 "--strategies", "kv-aware,round-robin")  # fmt: skip
    summaries = cli.run_real_cells(args, ["kv-aware", "round-robin"])
    assert "DES: kvgate bench" in capsys.readouterr().out  # the table over seeds
    by = {s.label.rsplit(": ", 1)[1]: [] for s in summaries}
    for s in summaries:
        by[s.label.rsplit(": ", 1)[1]].append(s)
    kv, rr = by["kv-aware"], by["round-robin"]
    assert len(kv) == len(rr) == 3
    kv_p90 = statistics.median(s.ttft_p90_ms for s in kv)
    rr_p90 = statistics.median(s.ttft_p90_ms for s in rr)
    assert kv_p90 <= 1.1 * rr_p90
    assert all(max(s.per_pod.values()) < 0.75 * s.requests for s in kv)  # both pods serve
    assert min(s.cached_ratio for s in kv) >= 0.89


def test_a_fit_that_found_no_running_cost_still_decodes_one_token_a_step(tmp_path):
    # A slow, noisy machine measured 245, 267 and 226 ms beside 0, 2 and 4 running
    # requests: a flat line, s_per_running 0. A decode step of 0 divided by zero.
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"fit": {"overhead_s": 0.0, "tokens_per_s": 2134.0,
                                        "s_per_running": 0.0}}))  # fmt: skip
    spec = real_cells.real_pod_spec(real_cells.load_fit(path))
    assert spec.timing.itl_s(1) == real_cells.DEFAULT_FIT.s_per_running
    assert spec.timing.beside_running_s(2) == 0.0  # what the fit measured stays
    args = _args("--real-cells", "chat@closed:4", "--real-fit", str(path))
    (summary,) = cli.run_real_cells(args, ["kv-aware"])
    assert summary.requests == 72


def test_the_measured_decode_step_times_the_simulated_pods_decode(tmp_path):
    path = tmp_path / "results.json"
    fit = {"overhead_s": 0.0, "tokens_per_s": 2134.0, "s_per_running": 0.0,
           "decode_step_s": 0.0047}  # fmt: skip
    path.write_text(json.dumps({"fit": fit}))
    loaded = real_cells.load_fit(path)
    assert loaded.decode_step_s == 0.0047
    assert real_cells.real_pod_spec(loaded).timing.itl_s(3) == pytest.approx(0.0047)


def test_a_percent_cell_runs_at_its_share_of_the_simulated_pods_capacity(capsys):
    args = _args("--real-cells", "users@poisson:50%,users@poisson:100%")
    from bench.des.cli import _capacity_rates, _progress

    with _progress() as bar:
        rates = _capacity_rates(args, args.real_cells.split(","), real_cells.real_pod_spec(
            real_cells.DEFAULT_FIT), bar)  # fmt: skip
    assert "capacity of users:" in capsys.readouterr().out  # measured once, said
    half, full = rates["users@poisson:50%"], rates["users@poisson:100%"]
    assert full == pytest.approx(2 * half)
    # Two pods of ~16k tokens/s, each of the 96 requests ~100-1,600 tokens uncached:
    # tens of requests a second.
    assert 10 < full < 200
    inp = real_cells.cell_input("users@poisson:50%", 0, "kv-aware", half)
    arrivals = [r.arrival_s for r in inp.requests]
    assert (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) == pytest.approx(half, rel=0.3)


def test_decode_check_puts_the_des_beside_each_cell_of_a_real_run(tmp_path):
    from bench.des.decode_check import compare

    plan = {"routers": ["kv-aware", "sglang-router:cache_aware"], "seeds": [0], "pods": 2}
    fit = {"overhead_s": 0.0, "tokens_per_s": 2134.0, "s_per_running": 0.0}
    cells = [{"workload": "chat", "load": "closed:4", "rate_rps": None}]
    (tmp_path / "results.json").write_text(json.dumps({"plan": plan, "fit": fit, "cells": cells}))
    real = [{"cell": "chat@closed:4", "router": "kv-aware", "ok": True, "ttft_ms": 100.0 + i,
             "e2e_ms": 400.0 + 2 * i} for i in range(10)]  # fmt: skip
    (tmp_path / "requests.jsonl").write_text("\n".join(map(json.dumps, real)))
    header, line = compare(tmp_path, decode_step_s=0.005)  # the peer is not the DES's
    assert line.split()[:2] == ["chat@closed:4", "kv-aware"]
    des_decode_p50, real_decode_p50 = float(line.split()[3]), float(line.split()[6])
    assert real_decode_p50 == 305.0  # e2e - TTFT: 300, 301, ..., 309
    assert des_decode_p50 >= 15 * 5  # 15 more tokens at 5 ms at least


def test_the_preset_prefix_workload_takes_its_size_and_requests_from_the_command(tmp_path):
    from dataclasses import replace

    from bench.des.cli import run_preset
    from bench.quick import PRESETS, build_workloads

    preset = replace(PRESETS["quick"], prefix_k=3.0, requests=30)
    (workload,) = build_workloads(["prefix"], preset, preset.pods, seed=0)
    # 3 x the fleet's L0 (4 pods x 256 blocks x 32 tokens = 32,768) in 2,000-token prefixes,
    # of which 30 requests draw some.
    assert workload.description.startswith(f"{round(3.0 * 32_768 / 2000)} prefixes of 2000")
    assert len(workload.requests()) == 30
    assert len({r.messages[0]["content"] for r in workload.requests()}) > 12  # 0.75 x: 12
    args = _args("--preset", "quick", "--workloads", "prefix", "--tiers", "L0",
                 "--prefix-k", "3", "--requests", "30")  # fmt: skip
    (summary,) = run_preset(args, ["round-robin"])
    assert summary.requests == 30


def test_the_preset_rag_workload_takes_its_corpus_size_from_the_command(tmp_path):
    from dataclasses import replace

    from bench.des.cli import run_preset
    from bench.quick import PRESETS, RAG_DOC_TOKENS, build_workloads

    (default,) = build_workloads(["rag"], PRESETS["quick"], PRESETS["quick"].pods, seed=0)
    assert default.description.startswith("12 documents of 1900")
    preset = replace(PRESETS["quick"], rag_k=4.0, requests=40)
    (workload,) = build_workloads(["rag"], preset, preset.pods, seed=0)
    # 4 x the fleet's L0 (4 pods x 256 blocks x 32 tokens = 32,768) in 1,900-token documents.
    docs = round(4.0 * 32_768 / RAG_DOC_TOKENS)
    assert workload.description.startswith(f"{docs} documents of {RAG_DOC_TOKENS}")
    assert len(workload.requests()) == 40
    documents = {r.messages[1]["content"].split("\n\nQuestion")[0] for r in workload.requests()}
    assert len(documents) > 12
    args = _args("--preset", "quick", "--workloads", "rag", "--tiers", "L0",
                 "--rag-k", "4", "--requests", "40")  # fmt: skip
    (summary,) = run_preset(args, ["round-robin"])
    assert summary.requests == 40


@pytest.mark.parametrize("flag", ["--prefix-k", "--rag-k"])
@pytest.mark.parametrize("k", ["0", "-1", "inf", "x"])
def test_a_working_set_size_that_is_not_above_zero_is_refused(flag, k):
    with pytest.raises(SystemExit):
        _args("--preset", "quick", flag, k)


def test_pod_slowdowns_reach_the_simulated_pods_and_the_reports_title(capsys):
    args = _args("--real-cells", "users@poisson:8", "--seed", "0", "--pod-slowdown", "2,1")
    assert args.pod_slowdown == (2.0, 1.0)
    summaries = cli.run_real_cells(args, ["round-robin"])
    assert "pod compute time x2,1" in capsys.readouterr().out
    (alike,) = cli.run_real_cells(_args("--real-cells", "users@poisson:8", "--seed", "0"),
                                  ["round-robin"])  # fmt: skip
    # Round-robin sends pod-0 (2x slower) half the requests: the fleet's median TTFT rises.
    assert summaries[0].ttft_p50_ms > 1.2 * alike.ttft_p50_ms


@pytest.mark.parametrize("text", ["0", "1,-2", "", "fast", "inf,1", "nan"])
def test_a_pod_slowdown_that_is_not_a_positive_number_is_refused(text):
    with pytest.raises(SystemExit):
        _args("--real-cells", "users@poisson:8", "--pod-slowdown", text)
