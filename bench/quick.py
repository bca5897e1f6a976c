"""Presets of the fleet benchmark, and ``kvgate bench quick`` (the README's first command).

``quick`` is ``kvgate bench fleet --preset quick``: 4 simulated pods, the RAG and
shared-prefix workloads, round-robin vs kv-aware, L0 only and L0+L1+L2, Poisson
load near round-robin's saturation, plus the peer routers (sglang-router and
vllm-router, installed on first use; ``--no-peers`` skips them) on the L0 tier. It
prints the headline table, kv-aware against each peer, and where the report went.

Time on 2 cores: a cell is ~25 s of load (300 requests at 12 qps) plus ~8 s to start
pods and router, so the 8 kvgate cells take ~4.5 min and the peers ~2 min more
(plus their one-time install). 300 requests, not the docs preset's 400: in simulated
time (``kvgate bench des --preset quick --seeds 0,...,7``) kv-aware's L0 p90 over 8
seeds stayed within 73-242 ms (RAG) and 80-282 ms (prefix) against round-robin's
1,115-1,568 and 2,736-6,136 ms, so the ratio the README promises does not hinge on
the seed. Peers run on L0 only, at the same 300 requests (so
their p90 is comparable with kv-aware's): with only L0 the router alone decides what
gets recomputed. With L2 on, every router's misses become cheap L2 loads: in
docs/BENCHMARKS.md all six routers' L0+L1+L2 p90s lay within 87-171 ms (91-5,870 ms
on L0), so L0+L1+L2 peer cells would add 3 minutes that measure the tier more than
the router. ``kvgate bench fleet --preset docs --peer NAME`` runs peers on every tier.

Why these numbers: pods are prefill-bound like a 7B model on one A10G (the
original deployment: ~4k prompt tokens/s, ~20 ms fixed, 10 ms per output token,
one prefill at a time), and each pod's L0 holds about half of the hot prefixes
while the fleet's L0 holds all of them. Round-robin then recomputes often and
queues; a cache-aware router partitions the prefixes and mostly loads them.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench.fleet import STRATEGIES, Cell, FleetPlan, Load, run_fleet
from bench.workloads import Workload, chat_workload, prefix_groups_workload, rag_workload

RAG_DOC_TOKENS = 1900  # each RAG document's length in the presets

QUICK_POD: dict[str, Any] = {
    "overhead_s": 0.02,
    "prefill_tokens_per_s": 4000.0,
    "itl_s": 0.01,
    "l0_capacity_blocks": 256,
    "max_num_seqs": 8,
    "prefill_concurrency": 1,
}


@dataclass(frozen=True)
class Preset:
    pods: int = 4
    pod_config: dict[str, Any] = field(default_factory=lambda: dict(QUICK_POD))
    workloads: tuple[str, ...] = ("rag", "prefix")
    routers: tuple[str, ...] = ("round-robin", "kv-aware")
    tiers: tuple[str, ...] = ("L0", "L0+L1+L2")
    loads: tuple[str, ...] = ("poisson:12",)
    requests: int = 400
    peers: tuple[str, ...] = ()  # peer routers (bench.peers) run after kvgate's
    peer_tiers: tuple[str, ...] | None = None  # tier setups the peers run on (None: all)
    l1_capacity_blocks: int = 2048
    # The shared-prefix workload's distinct prefix tokens as a multiple of the fleet's L0:
    # below 1 a router that partitions the prefixes keeps them all in L0; above 1 they
    # spill into L1/L2, where the tiers (and a router that knows them) matter.
    prefix_k: float = 0.75
    # The RAG workload's documents as a multiple of the fleet's L0, like ``prefix_k``;
    # None: 12 documents (~0.7x the default fleet's L0, so they all fit it).
    rag_k: float | None = None
    trace_requests: int = 200
    trace_speedup: float = 4.0
    trace_tokens_per_hash: int = 32


PRESETS = {
    # Round-robin and kv-aware, and the peers on L0: the comparison the README promises.
    "quick": Preset(peers=("sglang-router", "vllm-router"), peer_tiers=("L0",), requests=300),
    # docs/BENCHMARKS.md: every strategy (peers are added with --peer).
    "docs": Preset(routers=tuple(STRATEGIES)),
    "tiny": Preset(pods=2, workloads=("rag",), tiers=("L0",), loads=("poisson:8",), requests=20),
}


def build_workloads(
    names: list[str], preset: Preset, pods: int, seed: int, trace: Path | None = None
) -> list[Workload]:
    """The named workloads at the preset's sizes (same seed, same prompts)."""
    from bench.tinymodel import ensure_tokenizer

    tok = ensure_tokenizer()
    cfg = preset.pod_config
    fleet_l0_tokens = pods * int(cfg.get("l0_capacity_blocks", 4096)) * 32
    out: list[Workload] = []
    for name in names:
        if name == "rag":
            docs = 12
            if preset.rag_k is not None:
                docs = max(1, round(preset.rag_k * fleet_l0_tokens / RAG_DOC_TOKENS))
            out.append(
                rag_workload(
                    tok, docs=docs, doc_tokens=RAG_DOC_TOKENS, requests=preset.requests, seed=seed
                )
            )
        elif name == "prefix":
            out.append(
                prefix_groups_workload(
                    tok,
                    fleet_l0_tokens,
                    k=preset.prefix_k,
                    prefix_tokens=2000,
                    requests=preset.requests,
                    seed=seed,
                )
            )
        elif name == "chat":
            users = max(1, preset.requests // 12)
            out.append(chat_workload(tok, groups=4, users_per_group=users, rounds=3, seed=seed))
        elif name == "trace":
            from bench.trace import DEFAULT_TRACE, trace_workload

            out.append(
                trace_workload(
                    tok, trace or DEFAULT_TRACE, requests=preset.trace_requests,
                    speedup=preset.trace_speedup, tokens_per_hash=preset.trace_tokens_per_hash,
                    max_input_tokens=3800, seed=seed,
                )
            )  # fmt: skip
        else:
            raise ValueError(f"unknown workload {name!r}: rag, prefix, chat, trace")
    return out


def plan_from_preset(preset: Preset, seed: int = 0, **changes: Any) -> FleetPlan:
    plan = FleetPlan(
        workloads=build_workloads(list(preset.workloads), preset, preset.pods, seed),
        routers=list(dict.fromkeys([*preset.routers, *preset.peers])),
        tiers=list(preset.tiers),
        loads=[Load.parse(x) for x in preset.loads],
        pods=preset.pods,
        pod_config=dict(preset.pod_config),
        l1_capacity_blocks=preset.l1_capacity_blocks,
        seed=seed,
        peer_tiers=list(preset.peer_tiers) if preset.peer_tiers is not None else None,
    )
    for key, value in changes.items():
        setattr(plan, key, value)
    return plan


def wide_console() -> Console:
    """Rich assumes 80 columns when not on a terminal; tables here need more."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def print_headline(cells: list[Cell], console: Console) -> None:
    from bench.report import HEADLINE_COLUMNS, PEER_COLUMNS, headline_rows, headlines, peer_rows

    table = Table(title="kvgate fleet benchmark: TTFT p90, kv-aware vs round-robin")
    for col in HEADLINE_COLUMNS:
        table.add_column(col, overflow="fold")
    for row in headline_rows(headlines(cells)):
        table.add_row(*row)
    console.print(table)
    rows = peer_rows(cells)
    if rows:
        table = Table(title="kv-aware vs peers: TTFT p90 (ahead = kv-aware's is lower)")
        for col in PEER_COLUMNS:
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def print_cell(cell: Cell, console: Console, where: str = "", extra: str = "") -> None:
    """One line per finished cell, so a long run shows progress beyond the bar; ``where``
    replaces the cell's own label, ``extra`` goes before the errors."""
    where = where or f"{cell.workload:7} {cell.tiers:9} {cell.load:9} {cell.router:14}"
    if cell.summary is None:
        console.print(f"  {where} [yellow]skipped[/]: {cell.skipped}")
        return
    s = cell.summary
    console.print(
        f"  {where} TTFT p50 {s.ttft_p50_ms:7.0f} ms  p90 {s.ttft_p90_ms:7.0f} ms  "
        f"cached {s.cached_ratio:4.0%}  {extra}errors {s.errors}"
    )
    for message, count in s.error_kinds.items():
        console.print(f"    [red]{count} x[/] {escape(message)}", highlight=False)


def run_and_report(plan: FleetPlan, out_dir: Path, console: Console | None = None) -> list[Cell]:
    from bench.report import write_report

    console = console or wide_console()
    cells = run_fleet(plan, on_cell=lambda c: print_cell(c, console))
    command = (
        "kvgate bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        if len(sys.argv) > 2
        else "kvgate bench"
    )
    path = write_report(cells, plan, out_dir, command)
    print_headline(cells, console)
    console.print(f"report: {path}")
    return cells


def run_quick(
    out_dir: Path, seed: int = 0, peers: list[str] | None = None, console: Console | None = None
) -> list[Cell]:
    """The README's first command: the quick preset; ``peers`` replaces its peers."""
    preset = PRESETS["quick"]
    if peers is not None:
        preset = replace(preset, peers=tuple(peers))
    return run_and_report(plan_from_preset(preset, seed=seed), out_dir, console)
