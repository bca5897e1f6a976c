"""``kvgate``: one CLI for the gateway, the simulated pod, benchmarks and the index."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each subcommand's module (with ``add_arguments(parser)`` and ``run(args)``) is
# imported only when that subcommand is the one being run: `kvgate serve` starts
# without the benchmarks' imports (matplotlib ...) and `kvgate --help` without any.
_SUBCOMMANDS = {
    "serve": ("cli.serve", "run the gateway"),
    "sim": ("bench.sim.cli", "run a simulated vLLM pod (vLLM's API, metrics and KV events)"),
    "bench": ("bench.cli", "benchmarks: gateway overhead, index, fleet, discrete-event"),
    "index": ("cli.index", "inspect the KV index: stats, prompt lookup, per-pod counts"),
}


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="Cache-aware routing gateway for vLLM fleets with tiered KV caches.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in _SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == load:
            module = importlib.import_module(module_name)
            p.description = getattr(module, "DESCRIPTION", help_text)
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    load = argv[0] if argv and argv[0] in _SUBCOMMANDS else None
    args = build_parser(load).parse_args(argv)
    return int(args.func(args) or 0)
