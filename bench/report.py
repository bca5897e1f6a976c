"""The fleet benchmark's report directory: report.md, results.json and PNG plots.

Numbers come only from cells that ran; a cell that could not run shows its reason.
The headline compares kv-aware with round-robin (TTFT p90 ratio), gives the
cross-pod L2 hit rate where L2 is on, and each peer router's p90 relative to
kvgate's kv-aware on the same workload, tiers and load; the "kv-aware vs peers"
table says for each how far ahead (lower p90) or behind kv-aware is, whichever it is.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.fleet import Cell, FleetPlan, is_peer
from bench.peers import PEERS, peer_version
from bench.plots import write_plots
from bench.stats import pct

COLUMNS = (
    "router", "tiers", "load", "requests", "errors", "TTFT p50 ms", "TTFT p90 ms",
    "TTFT p99 ms", "req/s", "cached", "L0 hit", "L1 hit", "L2 hit", "cross-pod L2",
    "overhead ms", "decision ms", "TTFT pred. error",
)  # fmt: skip


def _ms(v: float | None) -> str:
    return "n/a" if v is None or math.isnan(v) else f"{v:.0f}" if abs(v) >= 10 else f"{v:.2f}"


def cell_row(c: Cell) -> list[str]:
    """One table row; a skipped cell keeps its identity and says why."""
    head = [c.router, c.tiers, c.load]
    if c.summary is None:
        return [*head, f"skipped: {c.skipped}", *[""] * (len(COLUMNS) - 4)]
    s, st = c.summary, c.stats
    return [
        *head,
        str(s.requests),
        f"{s.errors} ({s.error_rate:.0%})",
        _ms(s.ttft_p50_ms),
        _ms(s.ttft_p90_ms),
        _ms(s.ttft_p99_ms),
        f"{s.throughput_rps:.2f}",
        pct(s.cached_ratio),
        *[pct(st.tier_rate(t) if st else None) for t in ("L0", "L1", "L2")],
        pct(st.cross_pod_rate if st else None),
        _ms(c.overhead_ms),
        _ms(c.decision_ms),
        pct(s.ttft_prediction_error),
    ]


def markdown_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Headline:
    workload: str
    tiers: str
    load: str
    round_robin_p90_ms: float | None
    kv_aware_p90_ms: float | None
    cross_pod: dict[str, float]  # router -> share of its L2-served tokens another pod computed
    peers: dict[str, str]  # peer -> "p90 97 ms: kv-aware 1.29x ahead" or why it has no number

    @property
    def speedup(self) -> float | None:
        rr, kv = self.round_robin_p90_ms, self.kv_aware_p90_ms
        return rr / kv if rr and kv and not math.isnan(rr) and not math.isnan(kv) else None


def _p90(c: Cell | None) -> float | None:
    return c.summary.ttft_p90_ms if c is not None and c.summary is not None else None


def versus(kv_ms: float, peer_ms: float) -> str:
    """kv-aware against one peer by TTFT p90, as a ratio above 1 either way.

    Ahead: kv-aware's p90 is lower (peer / kv-aware); behind: higher (kv-aware / peer).
    """
    if kv_ms <= peer_ms:
        return f"kv-aware {peer_ms / kv_ms:.2f}x ahead"
    return f"kv-aware {kv_ms / peer_ms:.2f}x behind"


def headlines(cells: list[Cell]) -> list[Headline]:
    keys = list(dict.fromkeys((c.workload, c.tiers, c.load) for c in cells))
    out = []
    for key in keys:
        group = {c.router: c for c in cells if (c.workload, c.tiers, c.load) == key}
        kv = group.get("kv-aware")
        peers: dict[str, str] = {}
        for name in PEERS:
            if name in group:
                p, k = _p90(group[name]), _p90(kv)
                peers[name] = f"p90 {p:.0f} ms, {versus(k, p)}" if p and k else group[name].skipped
        rr = group.get("round-robin")
        cross = {
            name: c.stats.cross_pod_rate
            for name, c in (("round-robin", rr), ("kv-aware", kv))
            if c is not None and c.stats is not None and c.stats.cross_pod_rate is not None
        }
        out.append(Headline(*key, _p90(rr), _p90(kv), cross, peers))
    return out


def headline_rows(heads: list[Headline]) -> list[list[str]]:
    return [
        [
            h.workload, h.tiers, h.load, _ms(h.round_robin_p90_ms), _ms(h.kv_aware_p90_ms),
            "n/a" if h.speedup is None else f"{h.speedup:.1f}x",
            ", ".join(f"{k} {v:.0%}" for k, v in h.cross_pod.items()) or "n/a",
            "; ".join(f"{k}: {v}" for k, v in h.peers.items()) or "not asked",
        ]
        for h in heads
    ]  # fmt: skip


def peer_rows(cells: list[Cell]) -> list[list[str]]:
    """kv-aware against each peer that ran on the same workload, tiers and load."""
    kv_cells = {(c.workload, c.tiers, c.load): c for c in cells if c.router == "kv-aware"}
    rows = []
    for c in cells:
        kv = kv_cells.get((c.workload, c.tiers, c.load))
        if not is_peer(c.router) or c.summary is None or kv is None or kv.summary is None:
            continue
        k, p = kv.summary.ttft_p90_ms, c.summary.ttft_p90_ms
        if not k or not p or math.isnan(k) or math.isnan(p):
            continue
        rows.append([
            c.workload, c.tiers, c.load, _ms(k), c.router, _ms(p), versus(k, p),
            pct(kv.summary.cached_ratio), pct(c.summary.cached_ratio),
        ])  # fmt: skip
    return rows


PEER_COLUMNS = (
    "workload", "tiers", "load", "kv-aware p90 ms", "peer", "peer p90 ms", "kv-aware vs peer",
    "kv-aware cached", "peer cached",
)  # fmt: skip


HEADLINE_COLUMNS = (
    "workload", "tiers", "load", "round-robin p90 ms", "kv-aware p90 ms",
    "kv-aware vs round-robin", "cross-pod L2 share", "peers",
)  # fmt: skip


def _git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> str:
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        return f"{kb / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        return "unknown"


def environment(plan: FleetPlan, command: str) -> dict[str, str]:
    """Machine, versions and seeds: what a reader needs to rerun or discount the numbers."""
    env = {
        "command": command,
        "machine": f"{os.cpu_count()} CPUs ({_cpu_model()}), {_ram_gib()} RAM",
        "load average when written": " / ".join(f"{x:.1f}" for x in os.getloadavg())
        + " (1/5/15 min; other work on the machine inflates TTFT)",
        "python": platform.python_version(),
        "kvgate git sha": _git_sha(),
        "seed": str(plan.seed),
        "pods": "real: " + " ".join(plan.pods_url) if plan.pods_url else f"{plan.pods} simulated",
        "pod config": json.dumps({**plan.pod_config, "profile": plan.profile}),
        "index": "redis (real redis-server)" if plan.redis else "memory",
    }
    for name in PEERS:
        if name in plan.routers:
            env[f"{name} version"] = peer_version(name) or "not installed"
    return env


def render(
    cells: list[Cell],
    plan: FleetPlan,
    env: dict[str, str],
    plots: dict[str, list[Path]],
    workloads: dict[str, str],
) -> str:
    parts = ["# kvgate fleet benchmark", ""]
    parts += [
        markdown_table(("", ""), [[k, f"`{v}`" if k == "command" else v] for k, v in env.items()]),
        "",
    ]
    parts += [
        "## Headline",
        "",
        markdown_table(HEADLINE_COLUMNS, headline_rows(headlines(cells))),
        "",
    ]
    rows = peer_rows(cells)
    if rows:
        parts += ["## kv-aware vs peers", "", markdown_table(PEER_COLUMNS, rows), ""]
        parts += [
            "*ahead*: kv-aware's TTFT p90 is lower, by the peer's p90 / kv-aware's; *behind*: "
            "higher, by kv-aware's / the peer's. Same pods, prompts and arrivals, one run per "
            "cell: a p90 moves between runs and seeds (`kvgate bench des --preset quick --seeds "
            "0,1,2,3` shows the spread in simulated time), so read ratios near 1 as a tie.",
            "",
        ]
    parts += [
        "TTFT is client-observed (first streamed token). *overhead* = mean client TTFT minus the "
        "pods' own mean TTFT (router + HTTP hops); *decision* = kvgate's mean routing decision "
        "time (tokenize, index lookup, strategy). *cross-pod L2* = share of L2-served tokens "
        "computed by another pod. Hit columns are shares of prompt tokens.",
        "",
    ]
    for name, description in workloads.items():
        wcells = [c for c in cells if c.workload == name]
        parts += [f"## Workload `{name}`", "", description, ""]
        parts += [markdown_table(COLUMNS, [cell_row(c) for c in wcells]), ""]
        parts += failed_requests(wcells, lambda c: f"{c.router}, {c.tiers}, {c.load}")
        parts += [f"![{p.stem}]({p.name})" for p in plots.get(name, [])] + [""]
    return "\n".join(parts)


def failed_requests(cells: list[Cell], where: Callable[[Cell], str]) -> list[str]:
    """What each cell's failed requests said, as Markdown lines beginning with the cell's
    ``where`` (nothing when none failed): a count alone does not say what to look at."""
    lines = [
        f"- {where(c)}: {count} x `{code_span(message)}`"
        for c in cells
        if c.summary is not None
        for message, count in c.summary.error_kinds.items()
    ]
    return ["Failed requests:", "", *lines, ""] if lines else []


def code_span(text: str) -> str:
    """``text`` fit for one Markdown code span on one line: backticks would end the span
    and a newline the list item."""
    return " ".join(text.replace("`", "'").split())


def write_report(cells: list[Cell], plan: FleetPlan, out_dir: Path, command: str) -> Path:
    """Write report.md, results.json and the PNGs into ``out_dir``; returns report.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(cells, out_dir)
    env = environment(plan, command)
    workloads = {w.name: w.description for w in plan.workloads}
    path = out_dir / "report.md"
    path.write_text(render(cells, plan, env, plots, workloads))
    data: dict[str, Any] = {
        "environment": env,
        "cells": [
            {
                **c.as_json(),
                "overhead_ms": c.overhead_ms,
            }
            for c in cells
        ],
        "headline": [asdict(h) | {"speedup": h.speedup} for h in headlines(cells)],
    }
    (out_dir / "results.json").write_text(json.dumps(data, indent=2, default=str))
    return path


DOC_HEADER = """# Benchmarks

Generated, never typed: every number and plot below comes from the command in the
first table, run on the machine it names (sections after the fleet report name their
own command). Rerun it to refresh this page (it overwrites the PNGs under the report
directory and this file, keeping the other sections).

"""
# Other benchmarks' sections of the doc, each between its markers; rewriting the fleet
# report keeps them, and each benchmark rewrites only its own.
_SECTION_NAME = re.compile(r"[\w-]+")  # what a section's markers can name
_SECTION = re.compile(
    rf"<!-- kvgate-section:({_SECTION_NAME.pattern}) -->.*?<!-- /kvgate-section:\1 -->\n?", re.S
)


def write_benchmarks_doc(report_md: Path, doc: Path) -> Path:
    """Copy the report into ``doc`` with image links made relative to ``doc``'s folder."""
    body = images_relative(report_md.read_text().split("\n", 1)[1], report_md, doc)
    kept = "".join(m.group(0) for m in _SECTION.finditer(doc.read_text())) if doc.exists() else ""
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(DOC_HEADER + body.lstrip("\n") + ("\n" + kept if kept else ""))
    return doc


def images_relative(markdown: str, report_md: Path, doc: Path) -> str:
    """``markdown`` from beside ``report_md`` with its image links made relative to ``doc``."""
    rel = os.path.relpath(report_md.parent.resolve(), doc.parent.resolve())
    return re.sub(r"\]\(([^)/]+\.png)\)", lambda m: f"]({rel}/{m.group(1)})", markdown)


def check_section_name(name: str) -> str:
    """``name`` if a section's markers can name it, else ValueError."""
    if not _SECTION_NAME.fullmatch(name):
        raise ValueError(f"doc section {name!r}: letters, digits, _ and - only")
    return name


def write_doc_section(doc: Path, name: str, markdown: str) -> Path:
    """Put ``markdown`` into ``doc`` as its section ``name``: replaced where it is, else
    appended; the rest of ``doc`` stays as it was. A name its markers cannot match would
    be appended again on every write: refused."""
    check_section_name(name)
    block = f"<!-- kvgate-section:{name} -->\n{markdown.strip()}\n<!-- /kvgate-section:{name} -->\n"
    text = doc.read_text() if doc.exists() else DOC_HEADER
    found = [m for m in _SECTION.finditer(text) if m.group(1) == name]
    if found:
        text = text[: found[0].start()] + block + text[found[0].end() :]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    return doc
