"""``kvgate``: one CLI for the gateway, the simulated pod, benchmarks and the index."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import Any

from gateway.config import parse_pod_flag


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gateway",
        description="Run the OpenAI-compatible routing gateway in front of vLLM pods. "
        "Settings come from --config YAML, then KVGATE_* env, then these flags.",
    )
    p.add_argument("--config", type=Path, help="YAML settings file")
    p.add_argument("--host", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--admin-port", type=int, help="admin listener port on loopback (default 8001)")
    p.add_argument(
        "--pod",
        action="append",
        dest="pods",
        metavar="NAME=URL[,events=tcp://H:P][,replay=tcp://H:P][,models=a|b]",
        help="an upstream pod; repeat for each pod",
    )
    p.add_argument("--strategy", help="routing strategy (round-robin, least-loaded, ...)")
    p.add_argument("--max-body-bytes", type=int, help="request body limit (default 8 MiB)")
    p.add_argument("--log-level", help="debug, info, warning ...")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from gateway.config import load_settings
    from gateway.server import serve

    overrides: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "strategy": args.strategy,
        "max_body_bytes": args.max_body_bytes,
        "log_level": args.log_level,
    }
    if args.admin_port is not None:
        overrides["admin"] = {"port": args.admin_port}
    if args.pods:
        overrides["pods"] = [parse_pod_flag(p) for p in args.pods]
    settings = load_settings(args.config, **overrides)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    serve(settings)
    return 0


# Subcommands whose modules pull heavy imports (tokenizers, matplotlib ...): their
# flags are only loaded when that subcommand is the one being run, so `kvgate serve`
# starts without them.
_LAZY = {
    "sim": ("bench.sim.cli", "run a simulated vLLM pod (vLLM's API, metrics and KV events)"),
    "bench": ("bench.cli", "benchmarks: gateway overhead, index, fleet, discrete-event"),
    "index": ("gateway.index_cli", "inspect the KV index: stats, prompt lookup, per-pod counts"),
}


def build_parser(load: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="Cache-aware routing gateway for vLLM fleets with tiered KV caches.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    for name, (module, help_text) in _LAZY.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == load:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    load = argv[0] if argv and argv[0] in _LAZY else None
    args = build_parser(load).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
