"""Tables, report and plot of ``kvgate bench admission`` (``bench.admission``)."""

from __future__ import annotations

import math
import os
import platform
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.admission import PREFIX_TOKENS, PREFIXES, PROFILE, UNIQUE_TOKENS, Plan, Row
from bench.report import images_relative, markdown_table, write_doc_section

GOODPUT_COLUMNS = ("setup", "load", "offered req/s", "goodput req/s", "within SLO", "shed",
                   "TTFT p50 ms", "TTFT p90 ms")  # fmt: skip
FLOOD_COLUMNS = ("setup", "tenant (priority, load)", "offered req/s", "goodput req/s",
                 "within SLO", "shed", "TTFT p50 ms", "TTFT p90 ms")  # fmt: skip


def _ms(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:,.0f}"


def cells(r: Row) -> list[str]:
    return [r.setup, r.load, f"{r.offered_rps:.1f}", f"{r.goodput_rps:.1f}",
            f"{r.served_in_slo:.0%}", f"{r.shed:.0%}", _ms(r.ttft_p50_ms),
            _ms(r.ttft_p90_ms)]  # fmt: skip


def command(plan: Plan, out: Path, doc: Path | None) -> str:
    """The command line that reproduces this run, its output places included."""
    d = Plan()
    args = ["kvgate bench admission"]
    for flag, value, default in (("--pods", plan.pods, d.pods),
                                 ("--seconds", plan.seconds, d.seconds),
                                 ("--slo-ms", plan.slo_s * 1000, d.slo_s * 1000),
                                 ("--seed", plan.seed, d.seed)):  # fmt: skip
        if value != default:
            args.append(f"{flag} {value:g}")
    if plan.loads != d.loads:
        args.append("--loads " + ",".join(f"{x:g}" for x in plan.loads))
    args.append(f"--out {out}")
    if doc is not None:
        args.append(f"--doc {doc}")
    return " ".join(args)


def describe(plan: Plan) -> str:
    return (
        f"{plan.pods} simulated pods (profile `{PROFILE}`: Qwen2-7B on A10G, GPU cache "
        f"only), capacity ≈ {plan.capacity_rps():.1f} req/s (prefill-bound, prefix cached); "
        f"prompts: one of {PREFIXES} shared {PREFIX_TOKENS}-token prefixes plus "
        f"{UNIQUE_TOKENS[0]}-{UNIQUE_TOKENS[1]} unique tokens; Poisson arrivals for "
        f"{plan.seconds:g} s, seed {plan.seed}; TTFT SLO {plan.slo_s * 1000:.0f} ms. "
        "*goodput*: requests served within the SLO per second of arrivals; *within SLO* and "
        "*shed* (429) are shares of all requests; TTFT percentiles are of the served ones."
    )


def headline(plan: Plan, goodput: Sequence[Row], flood: Sequence[Row]) -> str:
    """Two sentences from the numbers: the heaviest load, and the high-priority tenant."""
    none, best = plan.setups()[0].label, plan.setups()[2].label
    top = goodput[-1].load

    def at(rows: Sequence[Row], setup: str, load: str) -> Row:
        return next(r for r in rows if r.setup == setup and r.load == load)

    g0, g1 = at(goodput, none, top), at(goodput, best, top)
    search = flood[0].load
    f0, f1 = at(flood, none, search), at(flood, best, search)
    return (
        f"At {top} the fleet's capacity, kv-aware serves {g1.goodput_rps:.1f} req/s within "
        f"the SLO with admission control ({best.split(': ', 1)[1]}) and "
        f"{g0.goodput_rps:.1f} req/s without it. Under the low-priority flood the "
        f"high-priority tenant's TTFT p90 is {_ms(f1.ttft_p90_ms)} ms with it and "
        f"{_ms(f0.ttft_p90_ms)} ms without."
    )


def print_tables(plan: Plan, goodput: Sequence[Row], flood: Sequence[Row]) -> None:
    console = Console(width=170) if not Console().is_terminal else Console()
    console.print(describe(plan))
    console.print(headline(plan, goodput, flood))
    for title, columns, rows in (("Goodput under overload", GOODPUT_COLUMNS, goodput),
                                 ("Priorities under a low-priority flood", FLOOD_COLUMNS,
                                  flood)):  # fmt: skip
        table = Table(title=title)
        for col in columns:
            table.add_column(col, justify="left" if col in columns[:2] else "right")
        for r in rows:
            table.add_row(*cells(r))
        console.print(table)


def plot(plan: Plan, goodput: Sequence[Row], flood: Sequence[Row], path: Path) -> Path:
    """Goodput against offered load, and each tenant's TTFT p90 in the flood, one colour
    per setup in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(dict.fromkeys(r.setup for r in [*goodput, *flood]))
    colors = {s: f"C{i}" for i, s in enumerate(setups)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.6))
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in goodput:
        series[r.setup].append((r.offered_rps, r.goodput_rps))
    for label, points in series.items():
        left.plot(*zip(*sorted(points), strict=True), marker="o", color=colors[label])
    left.axvline(plan.capacity_rps(), color="grey", linestyle=":")
    left.text(plan.capacity_rps(), 0, " capacity", color="grey", fontsize=8)
    left.set_xlabel("offered load (req/s)")
    left.set_ylabel(f"goodput (req/s within {plan.slo_s * 1000:.0f} ms TTFT)")
    left.set_title("Goodput under overload")
    left.grid(alpha=0.3)
    names = list(dict.fromkeys(r.load for r in flood))
    width = 0.8 / len(setups)
    for i, setup in enumerate(setups):
        p90 = {r.load: r.ttft_p90_ms for r in flood if r.setup == setup}
        xs = [n + (i - (len(setups) - 1) / 2) * width for n in range(len(names))]
        right.bar(xs, [p90.get(n, math.nan) for n in names], width, color=colors[setup])
    right.axhline(plan.slo_s * 1000, color="grey", linestyle=":")
    right.set_xticks(range(len(names)), names, fontsize=8)
    right.set_yscale("log")
    right.set_ylabel("TTFT p90 of served requests (ms, log; dotted: the SLO)")
    right.set_title("Priorities under a low-priority flood")
    right.grid(alpha=0.3, which="both", axis="y")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s in setups]
    fig.legend(handles, setups, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(plan: Plan, goodput: Sequence[Row], flood: Sequence[Row], wall_s: float,
           image: str, cmd: str) -> str:  # fmt: skip
    env = [["command", f"`{cmd}`"],
           ["machine", f"{os.cpu_count()} CPUs; simulated time, so the numbers do not depend "
            f"on it ({wall_s:.0f} s of wall time)"],
           ["python", platform.python_version()]]  # fmt: skip
    return "\n".join([
        "## Admission control under overload (simulated fleet)", "",
        markdown_table(("", ""), env), "", describe(plan), "", headline(plan, goodput, flood), "",
        "### Goodput under overload", "",
        markdown_table(GOODPUT_COLUMNS, [cells(r) for r in goodput]), "",
        "### Priorities under a low-priority flood", "",
        "`search` sends high-priority requests at 0.3x capacity while `batch` floods at "
        "1.5x and `etl` sends 0.15x, both low priority.", "",
        markdown_table(FLOOD_COLUMNS, [cells(r) for r in flood]), "",
        f"![admission]({image})", "",
    ])  # fmt: skip


def write_report(plan: Plan, goodput: Sequence[Row], flood: Sequence[Row], out: Path,
                 wall_s: float, doc: Path | None = None) -> Path:  # fmt: skip
    """report.md and admission.png in ``out``; the same as a section of ``doc`` if given."""
    out.mkdir(parents=True, exist_ok=True)
    image = plot(plan, goodput, flood, out / "admission.png")
    report = out / "report.md"
    body = render(plan, goodput, flood, wall_s, image.name, command(plan, out, doc))
    report.write_text("# kvgate admission benchmark\n\n" + body.split("\n", 2)[2])
    if doc is not None:
        write_doc_section(doc, "admission", images_relative(body, report, doc))
    return report
