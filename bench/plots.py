"""PNG plots of a fleet run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.fleet import Cell  # noqa: E402

TIER_COLORS = {"L0": "#4c72b0", "L1": "#55a868", "L2": "#c44e52", "cached": "#8172b2"}


def slug(*parts: str) -> str:
    return "_".join(re.sub(r"[^A-Za-z0-9]+", "-", p).strip("-").lower() for p in parts)


def ttft_cdf(cells: list[Cell], title: str, path: Path) -> Path:
    """One empirical CDF of TTFT per router (same workload, tiers and load)."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for cell in cells:
        xs = sorted(cell.ttfts_ms)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=cell.router)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    return _save(fig, ax, title, path)


def _save(fig: Any, ax: Any, title: str, path: Path) -> Path:
    """Title, log grid and legend, then write the PNG and free the figure."""
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_vs_qps(cells: list[Cell], title: str, path: Path) -> Path:
    """TTFT p90 against offered QPS, one line per router (Poisson loads only)."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for cell in cells:
        if cell.summary is None or not cell.load.endswith(" qps"):
            continue
        series[cell.router].append((float(cell.load.split()[0]), cell.summary.ttft_p90_ms))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for router, points in series.items():
        points.sort()
        ax.plot([q for q, _ in points], [t for _, t in points], marker="o", label=router)
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel("TTFT p90 (ms, log scale)")
    return _save(fig, ax, title, path)


def tier_breakdown(cells: list[Cell], title: str, path: Path) -> Path:
    """Stacked share of prompt tokens served per tier, one bar per (router, tiers, load)."""
    bars = [c for c in cells if c.summary is not None]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(bars) + 2), 4.6))
    labels = []
    for i, cell in enumerate(bars):
        labels.append(f"{cell.router}\n{cell.tiers}\n{cell.load}")
        bottom = 0.0
        stats = cell.stats
        shares = {}
        if stats is not None and stats.tiers_reported:
            shares = {t: stats.tier_rate(t) or 0.0 for t in ("L0", "L1", "L2")}
        elif cell.summary is not None:
            shares = {"cached": cell.summary.cached_ratio}
        for tier, share in shares.items():
            ax.bar(
                i,
                share * 100,
                bottom=bottom,
                color=TIER_COLORS[tier],
                label=tier if i == 0 else None,
            )
            bottom += share * 100
    ax.set_xticks(range(len(bars)), labels, fontsize=6)
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    handles, names = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, names, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(cells: list[Cell], out_dir: Path) -> dict[str, list[Path]]:
    """All plots per workload; returns workload -> PNG paths (relative names in out_dir)."""
    made: dict[str, list[Path]] = defaultdict(list)
    by_workload: dict[str, list[Cell]] = defaultdict(list)
    for cell in cells:
        by_workload[cell.workload].append(cell)
    for workload, wcells in by_workload.items():
        groups: dict[tuple[str, str], list[Cell]] = defaultdict(list)
        for c in wcells:
            if c.ttfts_ms:
                groups[(c.tiers, c.load)].append(c)
        for (tiers, load), group in groups.items():
            name = f"ttft_cdf_{slug(workload, tiers, load)}.png"
            made[workload].append(
                ttft_cdf(group, f"{workload}: TTFT CDF ({tiers}, {load})", out_dir / name)
            )
        for tiers in dict.fromkeys(c.tiers for c in wcells):
            tcells = [c for c in wcells if c.tiers == tiers and c.summary is not None]
            if len({c.load for c in tcells if c.load.endswith(" qps")}) > 1:
                name = f"ttft_vs_qps_{slug(workload, tiers)}.png"
                made[workload].append(
                    ttft_vs_qps(tcells, f"{workload}: TTFT p90 vs load ({tiers})", out_dir / name)
                )
        if any(c.summary is not None for c in wcells):
            name = f"tier_hits_{slug(workload)}.png"
            made[workload].append(
                tier_breakdown(wcells, f"{workload}: where prompt tokens came from", out_dir / name)
            )
    return made


def scale_plots(rows: list[Any], out_dir: Path) -> list[Path]:
    """Per workload and tiers: TTFT p90 and cached share against the number of replicas,
    one line per way of sharing state (and per router when there are several;
    ``bench.scaleout.ScaleRow`` rows)."""
    made = []
    for workload, tiers in dict.fromkeys((r.workload, r.tiers) for r in rows):
        group = [r for r in rows if (r.workload, r.tiers) == (workload, tiers)]
        routers = list(dict.fromkeys(r.router for r in group))
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
        for router, sharing in dict.fromkeys((r.router, r.sharing) for r in group):
            points = sorted((r.gateways, r.ttft_p90_ms, r.cached) for r in group
                            if (r.router, r.sharing) == (router, sharing)
                            and r.ttft_p90_ms is not None)  # fmt: skip
            xs = [p[0] for p in points]
            label = sharing if len(routers) == 1 else f"{router}, {sharing}"
            left.plot(xs, [p[1] for p in points], marker="o", label=label)
            right.plot(xs, [100 * (p[2] or 0) for p in points], marker="o", label=label)
        left.set_xlabel("gateway replicas")
        left.set_ylabel("TTFT p90 (ms, median over seeds)")
        right.set_xlabel("gateway replicas")
        right.set_ylabel("cached share of prompt tokens (%)")
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{workload} ({tiers}): {' / '.join(routers)} over N replicas")
        fig.tight_layout()
        path = out_dir / f"scaleout_{slug(workload, tiers)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def real_fleet_p90(summaries: list[Any], title: str, path: Path) -> Path:
    """Median TTFT p90 per router over seeds, with the best and worst seed as whiskers."""
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(summaries) + 1.5))
    names = [s.router for s in summaries]
    med = [s.p90_median_ms for s in summaries]
    low = [s.p90_median_ms - s.p90_best_ms for s in summaries]
    high = [s.p90_worst_ms - s.p90_median_ms for s in summaries]
    colors = ["#4c72b0" if ":" not in n and "router" not in n else "#999999" for n in names]
    ax.barh(names, med, xerr=[low, high], color=colors, capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("TTFT p90 (ms): median over seeds, whiskers best to worst")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
