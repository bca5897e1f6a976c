"""The scale-out report keeps each router's cells apart: rows, verdicts and medians are
per (workload, tiers, router, sharing, replicas), never pooled across routers."""

from __future__ import annotations

from bench.fleet import Cell
from bench.scaleout import scale_rows, summarize_scale, verdicts
from bench.summary import RunSummary


def _cell(router: str, n: int, p90: float, cached: float) -> Cell:
    summary = RunSummary(router, 100, 0, p90 / 2, p90, p90 * 2, p90 / 2, p90, cached, {}, 10.0)
    return Cell("prefix", "L0", "poisson:12", router, summary, gateways=n, per_gateway=[100])


def test_rows_and_verdicts_are_per_router():
    cells = [
        *(_cell("least-loaded", 1, p90, 0.30) for p90 in (100, 110, 120)),
        *(_cell("power-of-two", 1, p90, 0.50) for p90 in (200, 210, 220)),
        *(_cell("least-loaded", 4, p90, 0.29) for p90 in (130, 140, 150)),
        *(_cell("power-of-two", 4, p90, 0.50) for p90 in (205, 215, 225)),
    ]
    rows = summarize_scale(cells, lambda c: "redis")
    by = {(r.router, r.gateways): r for r in rows}
    assert len(rows) == 4
    assert by[("least-loaded", 1)].ttft_p90_ms == 110 and by[("least-loaded", 1)].seeds == 3
    assert by[("power-of-two", 4)].ttft_p90_ms == 215
    assert [r[2] for r in scale_rows(rows)] == ["least-loaded"] * 2 + ["power-of-two"] * 2
    vs = {v.router: v for v in verdicts(rows)}
    assert round(vs["least-loaded"].p90_ratio, 3) == round(140 / 110, 3)
    assert round(vs["least-loaded"].cached_points, 6) == -1.0
    assert round(vs["power-of-two"].p90_ratio, 3) == round(215 / 210, 3)


def test_failed_requests_are_listed_per_cell_on_one_markdown_line_each():
    from bench.report import failed_requests

    failed = _cell("kv-aware", 4, 100, 0.5)
    failed.summary.error_kinds.update({"502: pod `a` closed\nthe connection": 2})
    cells = [_cell("kv-aware", 1, 100, 0.5), failed]
    assert failed_requests(cells, lambda c: f"{c.router} x{c.gateways}") == [
        "Failed requests:",
        "",
        "- kv-aware x4: 2 x `502: pod 'a' closed the connection`",
        "",
    ]
    assert failed_requests(cells[:1], lambda c: "") == []


def test_the_written_report_lists_failed_requests_and_each_cells_seed(tmp_path):
    import json

    from bench.fleet import FleetPlan
    from bench.scaleout import write_scale_report

    one, four = _cell("kv-aware", 1, 100, 0.5), _cell("kv-aware", 4, 120, 0.5)
    four.summary.error_kinds["timed out"] = 1
    cells = [one, four]
    rows = summarize_scale(cells, lambda c: "redis")
    label = {id(c): "redis" for c in cells}
    seed_of = {id(one): 0, id(four): 2}
    command = "kvgate bench fleet --gateways 1,4"
    plan = FleetPlan(workloads=[])
    report = write_scale_report(cells, rows, verdicts(rows), plan, tmp_path, command, [0, 2],
                                label, seed_of)  # fmt: skip

    assert "- prefix, L0, kv-aware, redis x4, seed 2: 1 x `timed out`" in report.read_text()
    data = json.loads((tmp_path / "results.json").read_text())
    assert [(c["gateways"], c["seed"], c["sharing"]) for c in data["cells"]] == [
        (1, 0, "redis"), (4, 2, "redis")]  # fmt: skip
