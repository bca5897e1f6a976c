"""``kvgate bench``: benchmarks that print tables (and write reports with plots)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)

    p = sub.add_parser(
        "overhead",
        help="latency kvgate adds versus calling a pod directly, and requests/s",
        description="Starts one zero-latency simulated pod and a gateway in front of it, "
        "alternates direct and gateway requests, and prints the paired difference.",
    )
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--pairs", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0, help="closed-loop duration per path")
    p.add_argument("--strategy", default="round-robin")
    p.set_defaults(bench_func=_overhead)
    _add_quick(sub)
    _add_index(sub)
    _add_des(sub)


def _add_quick(sub: argparse._SubParsersAction) -> None:
    from bench.fleet_cli import add_fleet, add_quick

    add_quick(sub)
    add_fleet(sub)


def _add_index(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index",
        help="KV index: event ingestion blocks/s and lookup p50/p99 (memory and Redis)",
    )
    p.add_argument("--redis-url", help="benchmark RedisStore against this Redis")
    p.add_argument(
        "--no-redis",
        action="store_true",
        help="skip Redis (by default a redis-server is started on a free loopback port)",
    )
    p.add_argument("--lookups", type=int, default=1000)
    p.add_argument("--ingest-blocks", type=int, default=100_000)
    p.add_argument("--block-size", type=int, default=16)
    p.set_defaults(bench_func=_index)


def _index(args: argparse.Namespace) -> int:
    from rich.console import Console

    from bench.index_bench import run_index_benchmarks

    run_index_benchmarks(
        args.redis_url,
        not args.no_redis,
        args.lookups,
        args.ingest_blocks,
        args.block_size,
        Console(width=140),
    )
    return 0


def _overhead(args: argparse.Namespace) -> int:
    from bench.overhead import print_overhead, run_overhead_bench

    result = run_overhead_bench(
        prompt_tokens=args.prompt_tokens,
        pairs=args.pairs,
        concurrency=args.concurrency,
        seconds=args.seconds,
        strategy=args.strategy,
    )
    print_overhead(result)
    return 0


def _add_des(sub: argparse._SubParsersAction) -> None:
    from bench.des.cli import add_des_arguments

    p = sub.add_parser(
        "des",
        help="discrete-event fleet simulation: strategies on a trace in simulated time",
        description="Replays a Mooncake-format trace on N simulated pods per strategy and "
        "tier setup, with kvgate's own routing objects and the simulated pod's timing.",
    )
    add_des_arguments(p)
    p.set_defaults(bench_func=_des)


def _des(args: argparse.Namespace) -> int:
    from bench.des.cli import run_des_cli

    return run_des_cli(args)


def run(args: argparse.Namespace) -> int:
    return int(args.bench_func(args) or 0)
