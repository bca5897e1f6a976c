"""``kvgate bench quick``: the README's first command.

Starts a few simulated pods and kvgate in front of them, sends a short shared-prefix
chat workload once per routing strategy (fresh pods each time, so no strategy
inherits another's cache), and prints a table of TTFT, cached tokens and requests
per pod. No external services are needed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench.gateway_proc import run_gateway
from bench.loadgen import run_closed_loop
from bench.summary import RunSummary, summarize
from bench.workloads import shared_prefix_sessions

# Simulated pod timing: roughly a 7B model on one A10G (the original deployment):
# ~3.4k prompt tokens/s of prefill plus a fixed ~20 ms, ~10 ms per output token.
QUICK_POD = {
    "overhead_s": 0.02,
    "prefill_tokens_per_s": 3400.0,
    "itl_s": 0.01,
    "l0_capacity_blocks": 1024,
    "max_num_seqs": 8,
}


def run_quick(
    strategies: list[str],
    pods: int = 3,
    concurrency: int = 6,
    groups: int = 4,
    users_per_group: int = 4,
    rounds: int = 3,
    system_tokens: int = 1500,
    seed: int = 0,
    out_dir: Path | None = None,
    console: Console | None = None,
) -> list[RunSummary]:
    from bench.sim.launch import sim_fleet
    from bench.tinymodel import MODEL_NAME, ensure_tokenizer

    console = console or wide_console()
    sessions = shared_prefix_sessions(
        ensure_tokenizer(),
        groups=groups,
        users_per_group=users_per_group,
        rounds=rounds,
        system_tokens=system_tokens,
        seed=seed,
    )
    summaries: list[RunSummary] = []
    for strategy in strategies:
        with (
            sim_fleet(pods, kv_events=True, **QUICK_POD) as fleet,
            run_gateway([(p.name, _pod_spec(p)) for p in fleet], strategy=strategy) as gateway,
        ):
            started = time.perf_counter()
            results = asyncio.run(
                run_closed_loop(gateway, MODEL_NAME, sessions, concurrency, label=strategy)
            )
            summaries.append(summarize(strategy, results, time.perf_counter() - started))
    print_summaries(summaries, console)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "quick.json").write_text(json.dumps([asdict(s) for s in summaries], indent=2))
        console.print(f"report: {out_dir / 'quick.json'}")
    return summaries


def wide_console() -> Console:
    """Rich assumes 80 columns when not on a terminal; tables here need more."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _pod_spec(pod: object) -> str:
    url: str = pod.url  # type: ignore[attr-defined]
    events = getattr(pod, "events_endpoint", None)
    replay = getattr(pod, "replay_endpoint", None)
    if events:
        url += f",events={events}"
    if replay:
        url += f",replay={replay}"
    return url


def print_summaries(summaries: list[RunSummary], console: Console) -> None:
    table = Table(title="Shared-prefix chat through kvgate (simulated pods)")
    for col in (
        "strategy", "requests", "errors", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
        "cached tokens", "requests per pod",
    ):  # fmt: skip
        table.add_column(
            col, justify="left" if col in ("strategy", "requests per pod") else "right"
        )
    for s in summaries:
        table.add_row(
            s.label,
            str(s.requests),
            str(s.errors),
            f"{s.ttft_p50_ms:.0f}",
            f"{s.ttft_p90_ms:.0f}",
            f"{s.ttft_p99_ms:.0f}",
            f"{s.cached_ratio:.0%}",
            " ".join(f"{pod}:{n}" for pod, n in s.per_pod.items()),
        )
    console.print(table)
