"""``kvgate bench des``: replay a trace on a simulated fleet in simulated time.

    kvgate bench des --trace shared/data/mooncake_synthetic_trace.jsonl --pods 16 \\
        --strategies round-robin,kv-aware --tiers L0+L1+L2 --profile original
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.des.report import DesSummary, print_des, summarize_des
from bench.des.sim import run_des
from bench.des.types import TIER_SETUPS, DesPodSpec, DesRequest
from bench.des.workload import MOONCAKE_BLOCK_TOKENS, load_mooncake, poisson_arrivals
from bench.profiles import PROFILES, get_profile
from routing.registry import canonical_name

DEFAULT_STRATEGIES = "round-robin,least-loaded,prefix-aware,kv-aware"


def add_des_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    a("--pods", type=int, default=16)
    a("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated strategy names")
    a("--tiers", default="L0+L1+L2", help=f"comma-separated, of {', '.join(TIER_SETUPS)}")
    a("--profile", default="original", choices=sorted(PROFILES))
    a("--block-size", type=int, default=MOONCAKE_BLOCK_TOKENS,
      help="tokens per cache block (the trace's hash ids are 512-token blocks)")  # fmt: skip
    a("--l1-policy", choices=("write-through", "evict"), default="write-through")
    a("--no-l2-events", action="store_true",
      help="LMCache fs:// mode: pods publish no L2 events (the index never sees L2)")  # fmt: skip
    a("--time-scale", type=float, default=1.0, help="stretch inter-arrival times")
    a("--repeat", type=int, default=1, help="play the trace N times back to back")
    a("--limit", type=int, default=None, help="first N trace lines only")
    a("--poisson-rate", type=float, default=None, help="re-time arrivals as Poisson (req/s)")
    a("--seed", type=int, default=0)
    a("--event-delay-ms", type=float, default=0.0, help="KV event delay pod -> index")
    a("--scrape-interval-s", type=float, default=2.0, help="pod metrics refresh period")
    a("--out", type=Path, default=None, help="write summaries as JSON here")


def _spec(args: argparse.Namespace, tiers: str) -> DesPodSpec:
    base = DesPodSpec.from_profile(get_profile(args.profile), args.block_size, tiers)
    return DesPodSpec(
        timing=base.timing,
        block_size=base.block_size,
        l0_capacity_blocks=base.l0_capacity_blocks,
        l1_capacity_blocks=base.l1_capacity_blocks,
        l2_capacity_blocks=base.l2_capacity_blocks,
        l1_policy=args.l1_policy,
        max_num_seqs=base.max_num_seqs,
        l2_events=not args.no_l2_events,
    )


def _requests(args: argparse.Namespace) -> list[DesRequest]:
    reqs = load_mooncake(args.trace, time_scale=args.time_scale, repeat=args.repeat,
                         limit=args.limit)  # fmt: skip
    if args.poisson_rate:
        reqs = poisson_arrivals(reqs, args.poisson_rate, args.seed)
    return reqs


def run_des_cli(args: argparse.Namespace) -> int:
    requests = _requests(args)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    tier_setups = [t.strip() for t in args.tiers.split(",") if t.strip()]
    profile = get_profile(args.profile)
    summaries: list[DesSummary] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns) as bar:
        for tiers in tier_setups:
            spec = _spec(args, tiers)
            for strategy in strategies:
                task = bar.add_task(f"{strategy} {tiers}", total=len(requests))
                options = {"cost_model": profile.cost_model(spec.block_size)}
                started = time.perf_counter()
                results = run_des(
                    requests,
                    args.pods,
                    strategy,
                    spec,
                    strategy_options=options if canonical_name(strategy) == "kv-aware" else None,
                    event_delay_s=args.event_delay_ms / 1000,
                    scrape_interval_s=args.scrape_interval_s,
                    progress=lambda n, t=task: bar.update(t, completed=n),
                )
                wall = time.perf_counter() - started
                summaries.append(summarize_des(strategy, tiers, results, wall))
    title = (f"DES: {len(requests)} requests, {args.pods} pods, profile {args.profile}, "
             f"trace {args.trace.name}")  # fmt: skip
    print_des(summaries, title)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(s) for s in summaries], indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvgate bench des", description=__doc__.splitlines()[0])
    add_des_arguments(parser)
    return run_des_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
