"""``kvgate bench fleet --gateways 1,2,4,8``: kv-aware scaled out over gateway replicas.

Each cell is the fleet benchmark's (fresh simulated pods, the preset's workload and
Poisson arrivals) with N kvgate replicas in front instead of one, the load generator
picking a replica at random per request as a Kubernetes Service would. Two ways of
running the replicas:

* ``memory``: each replica has its own in-memory index (every replica follows every
  pod's KV events, so the indexes agree) and counts only its own in-flight requests;
  its speculative entries stay its own. What you get without shared state.
* ``redis``: one Redis holds the index and the speculative entries, and the replicas
  exchange their in-flight counts per pod (``gateway.fleet_load``).

Every (workload, sharing, N) runs once per seed; the report gives the median over
seeds of the cached share and TTFT p50/p90, the requests each replica served, each
replica's memory and Redis's, and the comparison the acceptance asks for: N replicas
sharing Redis against one replica (cached share in points, TTFT p90 as a ratio).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.fleet import Cell, FleetPlan, run_cell_retrying
from bench.report import environment, failed_requests, markdown_table

SHARING = ("memory", "redis")


@dataclass(frozen=True)
class ScaleRow:
    """One (workload, tiers, router, sharing, N) over its seeds."""

    workload: str
    tiers: str
    router: str
    sharing: str
    gateways: int
    seeds: int
    cached: float | None  # medians over seeds
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    errors: int
    per_gateway: list[int]  # requests per replica, the median seed's run
    rss_mib: float | None  # mean replica RSS
    redis_mib: float | None


def _median(cells: list[Cell], get: Callable[[Cell], float | None]) -> float | None:
    values = [v for c in cells if c.summary is not None and (v := get(c)) is not None]
    return statistics.median(values) if values else None


def summarize_scale(cells: list[Cell], sharing_of: Callable[[Cell], str]) -> list[ScaleRow]:
    groups: dict[tuple[str, str, str, str, int], list[Cell]] = {}
    for c in cells:
        key = (c.workload, c.tiers, c.router, sharing_of(c), c.gateways)
        groups.setdefault(key, []).append(c)
    rows = []
    for (workload, tiers, router, sharing, n), group in groups.items():
        ran = [c for c in group if c.summary is not None]
        by_p90 = sorted(ran, key=lambda c: c.summary.ttft_p90_ms)  # type: ignore[union-attr]
        mid = by_p90[len(by_p90) // 2] if by_p90 else None
        rss = [r for c in ran for r in c.gateway_rss_mib]
        rows.append(
            ScaleRow(
                workload, tiers, router, sharing, n, len(ran),
                _median(ran, lambda c: c.summary.cached_ratio),  # type: ignore[union-attr]
                _median(ran, lambda c: c.summary.ttft_p50_ms),  # type: ignore[union-attr]
                _median(ran, lambda c: c.summary.ttft_p90_ms),  # type: ignore[union-attr]
                sum(c.summary.errors for c in ran),  # type: ignore[union-attr]
                mid.per_gateway if mid is not None else [],
                statistics.mean(rss) if rss else None,
                _median(ran, lambda c: c.redis_mib),
            )
        )  # fmt: skip
    return rows


@dataclass(frozen=True)
class Verdict:
    workload: str
    tiers: str
    router: str
    gateways: int
    cached_points: float  # N shared minus one replica, percentage points
    p90_ratio: float  # N shared / one replica

    @property
    def holds(self) -> bool:
        """The acceptance bar: within 2 points of cached share and 10% of TTFT p90."""
        return self.cached_points >= -2.0 and self.p90_ratio <= 1.10


def verdicts(rows: list[ScaleRow], baseline_sharing: str = "redis") -> list[Verdict]:
    """Every N > 1 sharing Redis against one replica (same workload, tiers and router)."""
    base = {(r.workload, r.tiers, r.router): r for r in rows
            if r.gateways == 1 and r.sharing == baseline_sharing}  # fmt: skip
    out = []
    for r in rows:
        one = base.get((r.workload, r.tiers, r.router))
        if r.sharing != "redis" or r.gateways == 1 or one is None:
            continue
        if None in (r.cached, one.cached, r.ttft_p90_ms, one.ttft_p90_ms) or not one.ttft_p90_ms:
            continue
        points = (r.cached - one.cached) * 100  # type: ignore[operator]
        out.append(Verdict(r.workload, r.tiers, r.router, r.gateways, points,
                           r.ttft_p90_ms / one.ttft_p90_ms))  # type: ignore[operator]  # fmt: skip
    return out


def _fmt(v: float | None, pattern: str) -> str:
    return "n/a" if v is None else pattern.format(v)


SCALE_COLUMNS = ("workload", "tiers", "router", "sharing", "replicas", "seeds", "cached",
                 "TTFT p50 ms", "TTFT p90 ms", "errors", "requests per replica",
                 "RSS per replica MiB", "Redis MiB")  # fmt: skip


def scale_rows(rows: list[ScaleRow]) -> list[list[str]]:
    ordered = sorted(rows, key=lambda r: (r.workload, r.tiers, r.router, r.sharing, r.gateways))
    return [
        [r.workload, r.tiers, r.router, r.sharing, str(r.gateways), str(r.seeds),
         _fmt(r.cached, "{:.1%}"), _fmt(r.ttft_p50_ms, "{:.0f}"), _fmt(r.ttft_p90_ms, "{:.0f}"),
         str(r.errors),
         " / ".join(map(str, r.per_gateway)), _fmt(r.rss_mib, "{:.0f}"),
         _fmt(r.redis_mib, "{:.1f}")]
        for r in ordered
    ]  # fmt: skip


VERDICT_COLUMNS = ("workload", "tiers", "router", "replicas", "cached vs 1 replica",
                   "TTFT p90 vs 1 replica", "within 2 points and 10%")  # fmt: skip


def verdict_rows(vs: list[Verdict]) -> list[list[str]]:
    return [[v.workload, v.tiers, v.router, str(v.gateways), f"{v.cached_points:+.1f} points",
             f"{v.p90_ratio:.2f}x", "yes" if v.holds else "no"] for v in vs]  # fmt: skip


def run_scaleout(
    plan: FleetPlan,
    gateways: list[int],
    sharing: list[str],
    seeds: list[int],
    out_dir: Path,
    command: str,
    make_plan: Callable[[int], FleetPlan],
    console: Console | None = None,
) -> list[Cell]:
    """Every seed x workload x tiers x load x sharing x N, kv-aware (or ``plan.routers``)."""
    console = console or Console(width=160)
    cells: list[Cell] = []
    label: dict[int, str] = {}
    seed_of: dict[int, int] = {}
    for seed in seeds:
        seeded = make_plan(seed)
        for workload in seeded.workloads:
            for tier in seeded.tiers:
                for load in seeded.loads:
                    for mode in sharing:
                        for n in gateways:
                            for router in seeded.routers:
                                cell_plan = replace(seeded, gateways=n, redis=mode == "redis")
                                cell = run_cell_retrying(cell_plan, workload, tier, load, router)
                                label[id(cell)], seed_of[id(cell)] = mode, seed
                                cells.append(cell)
                                _print_cell(cell, mode, seed, console)
    rows = summarize_scale(cells, lambda c: label[id(c)])
    vs = verdicts(rows)
    write_scale_report(cells, rows, vs, plan, out_dir, command, seeds, label, seed_of)
    table = Table(title="kv-aware scaled out: median over seeds")
    for col in SCALE_COLUMNS:
        table.add_column(col, overflow="fold")
    for row in scale_rows(rows):
        table.add_row(*row)
    console.print(table)
    if vs:
        table = Table(title="N replicas sharing Redis vs one replica")
        for col in VERDICT_COLUMNS:
            table.add_column(col)
        for row in verdict_rows(vs):
            table.add_row(*row)
        console.print(table)
    console.print(f"report: {out_dir / 'report.md'}")
    return cells


def _print_cell(cell: Cell, mode: str, seed: int, console: Console) -> None:
    from bench.quick import print_cell

    where = f"{cell.workload:7} {cell.tiers:5} {cell.router:13} {mode:6} x{cell.gateways:<2}"
    where += f" seed {seed}"
    print_cell(cell, console, where, f"per replica {cell.per_gateway}  ")


def write_scale_report(
    cells: list[Cell],
    rows: list[ScaleRow],
    vs: list[Verdict],
    plan: FleetPlan,
    out_dir: Path,
    command: str,
    seeds: list[int],
    label: dict[int, str],
    seed_of: dict[int, int],
) -> Path:
    from bench.plots import scale_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(plan, command)
    env["seed"] = ", ".join(map(str, seeds)) + " (medians over these)"
    env["index"] = "per sharing column: memory (each replica its own) or redis (one, shared)"
    plots = scale_plots(rows, out_dir)
    parts = ["# kvgate scaled out: gateway replicas", ""]
    parts += [markdown_table(("", ""), [[k, f"`{v}`" if k == "command" else v]
                                        for k, v in env.items()]), ""]  # fmt: skip
    if vs:
        parts += ["## N replicas sharing Redis vs one replica", ""]
        parts += [markdown_table(VERDICT_COLUMNS, verdict_rows(vs)), ""]
    parts += ["## Every configuration", "", markdown_table(SCALE_COLUMNS, scale_rows(rows)), ""]
    parts += [
        "*memory*: each replica its own in-memory index and its own in-flight counts; "
        "*redis*: one Redis index (speculative entries included) and in-flight counts "
        "exchanged between replicas. The load generator picks a replica at random per "
        "request. *cached* = cached prompt tokens / prompt tokens as the pods reported; "
        "TTFT is client-observed. *requests per replica* is from the median seed's run; "
        "*RSS* is each replica's resident memory at the end of a run (mean), *Redis* its "
        "used_memory.",
        "",
    ]
    parts += failed_requests(
        cells,
        lambda c: (
            f"{c.workload}, {c.tiers}, {c.router}, {label[id(c)]} x{c.gateways}, "
            f"seed {seed_of[id(c)]}"
        ),
    )
    parts += [f"![{p.stem}]({p.name})" for p in plots] + [""]
    (out_dir / "report.md").write_text("\n".join(parts))
    data = {
        "environment": env,
        "rows": [asdict(r) for r in rows],
        "verdicts": [asdict(v) | {"holds": v.holds} for v in vs],
        "cells": [{**c.as_json(), "sharing": label[id(c)], "seed": seed_of[id(c)]} for c in cells],
    }
    (out_dir / "results.json").write_text(json.dumps(data, indent=2, default=str))
    return out_dir / "report.md"
