"""Several runs of ``kvgate bench overhead`` (``--runs N``) summed up.

One run's numbers move with the machine (a shared 2-core VM drifts 20-40% in speed), so
a target is judged over runs: per router and workload the **median and the worst** of
each column, the req/s of N workers over one worker's *in the same run*, and each of
the targets kvgate holds its hot path to (docs/performance.md) with its median, its
worst and in how many runs it was met. The best run is never reported on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Protocol


class Result(Protocol):
    router: str
    workload: str
    run: int
    added_p50_ms: float
    added_p99_ms: float
    stream_ttft_added_ms: float
    rps: float
    cpu_ms: float
    machine_ms: float


# (column, attribute, True: lower is better)
COLUMNS: tuple[tuple[str, str, bool], ...] = (
    ("added p50 ms", "added_p50_ms", True),
    ("added p99 ms", "added_p99_ms", True),
    ("stream TTFT added ms", "stream_ttft_added_ms", True),
    ("req/s", "rps", False),
    ("CPU ms/req", "cpu_ms", True),
    ("machine ms", "machine_ms", True),  # the machine's speed then (slower: higher)
)


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if v == v]


def median_and_worst(values: Sequence[float], lower_is_better: bool) -> tuple[float, float]:
    """(median, worst) of the finite ``values``; NaN, NaN when there are none."""
    ok = _finite(values)
    if not ok:
        return float("nan"), float("nan")
    return median(ok), (max(ok) if lower_is_better else min(ok))


def cells(results: Sequence[Result]) -> list[tuple[str, str]]:
    """(router, workload) in the order first measured."""
    return list(dict.fromkeys((r.router, r.workload) for r in results))


def per_run(results: Sequence[Result], router: str, workload: str, attr: str) -> dict[int, float]:
    return {r.run: getattr(r, attr) for r in results
            if r.router == router and r.workload == workload}  # fmt: skip


def column_stats(
    results: Sequence[Result],
) -> dict[tuple[str, str], dict[str, tuple[float, float]]]:
    """(router, workload), in the order first measured -> column attribute -> (median,
    worst) over the runs."""
    return {
        (router, workload): {
            attr: median_and_worst(list(per_run(results, router, workload, attr).values()), lower)
            for _, attr, lower in COLUMNS
        }
        for router, workload in cells(results)
    }


def scaling(results: Sequence[Result]) -> list[tuple[str, str, list[float]]]:
    """(``kvgate:S@N``, workload, per-run req/s of N workers over one worker's)."""
    out: list[tuple[str, str, list[float]]] = []
    for router, workload in cells(results):
        base, at, n = router.partition("@")
        if not at or not base.startswith("kvgate:"):
            continue
        many = per_run(results, router, workload, "rps")
        one = per_run(results, base, workload, "rps")
        ratios = [many[k] / one[k] for k in many if k in one and one[k] > 0 and many[k] == many[k]]
        if ratios:
            out.append((router, workload, ratios))
    return out


@dataclass(frozen=True)
class Target:
    """A target on one measured value per run: ``value(results, run)`` (None: not
    measured in this report) against ``limit`` (``at_most``: value <= limit)."""

    name: str
    value: Callable[[Sequence[Result], int], float | None]
    limit: float
    at_most: bool

    def met(self, v: float) -> bool:
        return v <= self.limit if self.at_most else v >= self.limit


def _one(router: str, workload: str, attr: str) -> Callable[[Sequence[Result], int], float | None]:
    def value(results: Sequence[Result], run: int) -> float | None:
        v = per_run(results, router, workload, attr).get(run)
        return v if v is not None and v == v else None

    return value


def _worst_stream(results: Sequence[Result], run: int) -> float | None:
    """The largest streaming TTFT added by any one-process kvgate strategy in ``run``."""
    values = [r.stream_ttft_added_ms for r in results if r.run == run
              and r.router.startswith("kvgate:") and "@" not in r.router]  # fmt: skip
    ok = _finite(values)
    return max(ok) if ok else None


def _ratio(router: str, workload: str) -> Callable[[Sequence[Result], int], float | None]:
    def value(results: Sequence[Result], run: int) -> float | None:
        many = per_run(results, router, workload, "rps").get(run)
        one = per_run(results, router.partition("@")[0], workload, "rps").get(run)
        if many is None or not one or many != many or one != one:
            return None
        return many / one

    return value


_RR, _KV = "kvgate:round-robin", "kvgate:kv-aware"
TARGETS: tuple[Target, ...] = (
    Target("round-robin: added p50 <= 0.5 ms", _one(_RR, "varied", "added_p50_ms"), 0.5, True),
    Target("round-robin: >= 3,000 req/s", _one(_RR, "varied", "rps"), 3000, False),
    Target("kv-aware, varied: added p50 <= 2 ms", _one(_KV, "varied", "added_p50_ms"), 2.0, True),
    Target("kv-aware, multi-turn: added p50 <= 1 ms",
           _one(_KV, "multi-turn", "added_p50_ms"), 1.0, True),
    Target("kv-aware, multi-turn: >= 1,500 req/s", _one(_KV, "multi-turn", "rps"), 1500, False),
    Target("streaming TTFT added <= 1 ms, every strategy (its worst)", _worst_stream, 1.0, True),
    Target("kv-aware, varied: --workers 2 >= 1.6x the req/s of one",
           _ratio(f"{_KV}@2", "varied"), 1.6, False),
)  # fmt: skip


@dataclass(frozen=True)
class TargetOutcome:
    target: Target
    values: list[float]  # one per run that measured it
    # The machine's speed in each of those runs (the median of its rows' machine ms), to
    # tell a miss on a slow machine from one on a fast machine.
    machine_ms: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return median(self.values)

    @property
    def worst(self) -> float:
        return max(self.values) if self.target.at_most else min(self.values)

    @property
    def runs_met(self) -> int:
        return sum(self.target.met(v) for v in self.values)

    def machine_when(self, met: bool) -> float | None:
        """The median machine ms of the runs that met (or missed) the target."""
        ms = _finite([m for v, m in zip(self.values, self.machine_ms, strict=False)
                      if self.target.met(v) == met])  # fmt: skip
        return median(ms) if ms else None


def judge(results: Sequence[Result], runs: int) -> list[TargetOutcome]:
    """Every target this report measured, over its runs."""
    out = []
    for target in TARGETS:
        measured = [
            (run, v) for run in range(runs) if (v := target.value(results, run)) is not None
        ]
        if measured:
            values = [v for _, v in measured]
            machine = [run_machine_ms(results, run) for run, _ in measured]
            out.append(TargetOutcome(target, values, machine))
    return out


def run_machine_ms(results: Sequence[Result], run: int) -> float:
    """The median machine ms over one run's rows (NaN when none was sampled)."""
    ms = _finite([r.machine_ms for r in results if r.run == run])
    return median(ms) if ms else float("nan")


def _fmt(v: float, attr: str) -> str:
    if v != v:
        return ""
    if attr == "rps":
        return f"{v:,.0f}"
    if attr in ("cpu_ms", "machine_ms"):
        return f"{v:.2f}"
    return f"{v:+.2f}"


def markdown(results: Sequence[Result], runs: int) -> list[str]:
    """The summary's tables as markdown lines."""
    lines = [
        f"## Over {runs} runs: median (worst)",
        "",
        "| router | workload | " + " | ".join(c for c, _, _ in COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    for (router, workload), stats in column_stats(results).items():
        row = [f"{_fmt(m, attr)} ({_fmt(w, attr)})" if m == m else ""
               for attr, (m, w) in stats.items()]  # fmt: skip
        lines.append(f"| {router} | {workload} | " + " | ".join(row) + " |")
    ratios = scaling(results)
    if ratios:
        lines += ["", "Workers: req/s of N workers over one worker's in the same run.", "",
                  "| router | workload | median | worst | per run |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for router, workload, values in ratios:
            lines.append(f"| {router} | {workload} | {median(values):.2f}x | {min(values):.2f}x | "
                         + ", ".join(f"{v:.2f}" for v in values) + " |")  # fmt: skip
    outcomes = judge(results, runs)
    if outcomes:
        lines += ["", "Targets (docs/performance.md); *machine ms*: the median machine ms of "
                  "the runs that met it / missed it:", "",
                  "| target | median | worst | runs met | machine ms, met / missed |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for o in outcomes:
            when = " / ".join(f"{m:.2f}" if m is not None else "-"
                              for m in (o.machine_when(True), o.machine_when(False)))  # fmt: skip
            lines.append(f"| {o.target.name} | {o.median:,.2f} | {o.worst:,.2f} | "
                         f"{o.runs_met} of {len(o.values)} | {when} |")  # fmt: skip
    return lines
