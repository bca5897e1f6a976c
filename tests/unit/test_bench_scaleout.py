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
