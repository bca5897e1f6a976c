"""Summaries and the rich table of DES runs (one row per strategy and tier setup)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import mean, median

from rich.console import Console
from rich.table import Table

from bench.des.types import DesResult
from bench.stats import pct, percentile, prediction_error


@dataclass(frozen=True)
class DesSummary:
    label: str
    tiers: str
    requests: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    hit_l0: float  # share of prompt tokens served from each tier
    hit_l1: float
    hit_l2: float
    cross_pod_l2: float  # share of L2 tokens another pod wrote
    per_pod: dict[str, int]
    simulated_s: float
    wall_s: float
    ttft_prediction_error: float | None = None  # median |predicted - observed| / observed

    @property
    def cached_ratio(self) -> float:
        return self.hit_l0 + self.hit_l1 + self.hit_l2


def summarize_des(
    label: str, tiers: str, results: Sequence[DesResult], wall_s: float
) -> DesSummary:
    """The served requests' numbers (requests shed by admission control never ran)."""
    results = [r for r in results if not r.shed]
    ttft = [r.ttft_s * 1000 for r in results]
    prompt = sum(r.prompt_tokens for r in results) or 1
    l2 = sum(r.l2_tokens for r in results)
    end = max((r.arrival_s + r.e2e_s for r in results), default=0.0)
    start = min((r.arrival_s for r in results), default=0.0)
    return DesSummary(
        label=label,
        tiers=tiers,
        requests=len(results),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        e2e_p50_ms=percentile([r.e2e_s * 1000 for r in results], 50),
        hit_l0=sum(r.l0_tokens for r in results) / prompt,
        hit_l1=sum(r.l1_tokens for r in results) / prompt,
        hit_l2=l2 / prompt,
        cross_pod_l2=sum(r.l2_cross_pod_tokens for r in results) / l2 if l2 else 0.0,
        per_pod=dict(sorted(Counter(r.pod for r in results).items())),
        simulated_s=end - start,
        wall_s=wall_s,
        ttft_prediction_error=prediction_error(results),
    )


def _per_pod(per_pod: dict[str, int]) -> str:
    counts = list(per_pod.values())
    if len(counts) <= 4:
        return " ".join(f"{p}:{n}" for p, n in per_pod.items())
    return f"min {min(counts)} / max {max(counts)} over {len(counts)}"


def des_table(summaries: Sequence[DesSummary], title: str) -> Table:
    table = Table(title=title)
    columns = ("strategy", "tiers", "requests", "TTFT p50 ms", "TTFT p90 ms",
               "TTFT p99 ms", "L0 hit", "L1 hit", "L2 hit", "L2 cross-pod",
               "TTFT pred. error", "requests per pod", "wall s")  # fmt: skip
    for col in columns:
        left = col in ("strategy", "tiers", "requests per pod")
        table.add_column(col, justify="left" if left else "right")
    for s in summaries:
        table.add_row(
            s.label,
            s.tiers,
            str(s.requests),
            f"{s.ttft_p50_ms:.0f}",
            f"{s.ttft_p90_ms:.0f}",
            f"{s.ttft_p99_ms:.0f}",
            f"{s.hit_l0:.1%}",
            f"{s.hit_l1:.1%}",
            f"{s.hit_l2:.1%}",
            f"{s.cross_pod_l2:.0%}",
            pct(s.ttft_prediction_error),
            _per_pod(s.per_pod),
            f"{s.wall_s:.1f}",
        )
    return table


def print_des(summaries: Sequence[DesSummary], title: str, console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console = Console(width=170)
    console.print(des_table(summaries, title))


def over_seeds_table(groups: Mapping[tuple[str, str], Sequence[DesSummary]], title: str) -> Table:
    """One row per (label, tiers): TTFT p90 median and range over seeds, mean cached share."""
    table = Table(title=title)
    columns = ("strategy", "tiers", "seeds", "TTFT p90 median ms", "p90 min ms", "p90 max ms",
               "TTFT p50 median ms", "cached mean", "L2 cross-pod mean",
               "TTFT pred. error median")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="left" if col in ("strategy", "tiers") else "right")
    for (label, tiers), runs in groups.items():
        p90 = [s.ttft_p90_ms for s in runs]
        table.add_row(
            label,
            tiers,
            str(len(runs)),
            f"{median(p90):.0f}",
            f"{min(p90):.0f}",
            f"{max(p90):.0f}",
            f"{median(s.ttft_p50_ms for s in runs):.0f}",
            f"{mean(s.cached_ratio for s in runs):.1%}",
            f"{mean(s.cross_pod_l2 for s in runs):.0%}",
            pct(_median_or_none([s.ttft_prediction_error for s in runs])),
        )
    return table


def _median_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return median(known) if known else None


def print_over_seeds(
    groups: Mapping[tuple[str, str], Sequence[DesSummary]],
    title: str,
    console: Console | None = None,
) -> None:
    console = console or Console()
    if not console.is_terminal:
        console = Console(width=170)
    console.print(over_seeds_table(groups, title))
