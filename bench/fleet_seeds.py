"""``kvgate bench seeds``: fleet reports of several seeds, as one table of medians.

A fleet run (``kvgate bench fleet --seed N --out DIR``) is one seed: one p90 per cell,
which moves from seed to seed. This reads the ``results.json`` of several such runs
(same plan, different seeds) and reports, per workload, tier setup, load and router,
the median and the worst TTFT p90 over the seeds, the median cached share and the
pods' own median TTFT, and kv-aware against each peer by median p90.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fleet import is_peer
from bench.podstats import FleetStats


@dataclass(frozen=True)
class OverSeeds:
    workload: str
    tiers: str
    load: str
    router: str
    seeds: int
    p90_median_ms: float
    p90_worst_ms: float
    cached_median: float
    pod_ttft_median_ms: float | None  # the pods' own mean TTFT: routing's effect without the hops
    # per tier, the median over seeds of its share of the prompt tokens; None: the pods
    # did not report tiers (real vLLM pods do not)
    tier_shares: dict[str, float] | None = None


@dataclass(frozen=True)
class FleetRun:
    command: str  # the ``kvgate bench fleet`` command its report names
    cells: list[dict[str, Any]]  # the cells that ran (skipped ones left out)


def load_runs(dirs: Sequence[Path]) -> list[FleetRun]:
    """Each run directory's results.json."""
    runs = []
    for d in dirs:
        data = json.loads((d / "results.json").read_text())
        cells = [c for c in data["cells"] if not c.get("skipped") and c.get("summary")]
        runs.append(FleetRun(data["environment"].get("command", "?"), cells))
    return runs


def over_seeds(runs: Sequence[FleetRun]) -> list[OverSeeds]:
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for c in (c for run in runs for c in run.cells):
        groups.setdefault((c["workload"], c["tiers"], c["load"], c["router"]), []).append(c)
    rows = []
    for (workload, tiers, load, router), runs in groups.items():
        p90 = [c["summary"]["ttft_p90_ms"] for c in runs]
        stats = [FleetStats(**c["stats"]) if c.get("stats") else None for c in runs]
        pod = [s.pod_ttft_mean_s * 1000 for s in stats if s and s.pod_ttft_mean_s is not None]
        rows.append(OverSeeds(
            workload, tiers, load, router, len(runs), statistics.median(p90), max(p90),
            statistics.median(c["summary"]["cached_ratio"] for c in runs),
            statistics.median(pod) if pod else None, _tier_shares(stats),
        ))  # fmt: skip
    return rows


def _tier_shares(stats: Sequence[FleetStats | None]) -> dict[str, float] | None:
    """Per tier, the median over the cells' ``stats`` of the share of prompt tokens it
    served (a tier a cell does not name served it nothing)."""
    reported = [s for s in stats if s is not None and s.tiers_reported and s.prompt_tokens]
    if len(reported) < len(stats):
        return None
    tiers = sorted({t for s in reported for t in s.tier_tokens})
    return {t: statistics.median(s.tier_rate(t) or 0.0 for s in reported) for t in tiers} or None


def _tier_cell(shares: dict[str, float] | None) -> str:
    return "n/a" if shares is None else " / ".join(f"{t} {s:.0%}" for t, s in shares.items())


DEFAULT_TITLE = "Fleet over seeds"


def render(
    rows: Sequence[OverSeeds],
    command: str,
    runs: Sequence[tuple[str, str]] = (),
    title: str = DEFAULT_TITLE,
) -> str:
    """Markdown of ``rows``; ``runs``: (fleet command, link to its report) per seed."""
    lines = [
        f"## {title}",
        "",
        f"Command: `{command}`, over these runs of one plan (each report has its plots):",
        "",
        *(f"- `{run}` ([report]({link}))" for run, link in runs),
        "",
        "Median and worst TTFT p90 over the seeds; *pod TTFT* is the median over seeds of "
        "the pods' own mean TTFT (the routing's effect without the HTTP hops and the "
        "router's own time); *served from* is the median over seeds of each tier's share of "
        "the prompt tokens (simulated pods report it).",
        "",
        "| workload | tiers | load | router | seeds | TTFT p90 median ms | p90 worst ms | cached "
        "| pod TTFT ms | served from |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pod = "n/a" if r.pod_ttft_median_ms is None else f"{r.pod_ttft_median_ms:.0f}"
        lines.append(
            f"| {r.workload} | {r.tiers} | {r.load} | {r.router} | {r.seeds} | "
            f"{r.p90_median_ms:.0f} | {r.p90_worst_ms:.0f} | {r.cached_median:.1%} | {pod} | "
            f"{_tier_cell(r.tier_shares)} |"
        )
    lines += ["", "| workload | tiers | load | peer | kv-aware p90 / peer p90 (median) | "
              "kv-aware worst / peer worst ms |", "|---|---|---|---|---|---|"]  # fmt: skip
    kv_aware = {(k.workload, k.tiers, k.load): k for k in rows if k.router == "kv-aware"}
    for r in rows:
        kv = kv_aware.get((r.workload, r.tiers, r.load))
        if not is_peer(r.router) or kv is None:
            continue
        lines.append(
            f"| {r.workload} | {r.tiers} | {r.load} | {r.router} | "
            f"{kv.p90_median_ms / r.p90_median_ms:.2f} | {kv.p90_worst_ms:.0f} / "
            f"{r.p90_worst_ms:.0f} |"
        )
    lines += ["", "Below 1: kv-aware's p90 is lower. A ratio near 1 is a tie."]
    return "\n".join(lines) + "\n"
