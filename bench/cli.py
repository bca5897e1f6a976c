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


def run(args: argparse.Namespace) -> int:
    return int(args.bench_func(args) or 0)
