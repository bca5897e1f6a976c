"""``kvgate serve``: run the gateway in front of vLLM pods."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path
from typing import Any

DESCRIPTION = (
    "Run the OpenAI-compatible routing gateway in front of vLLM pods. "
    "Settings come from --config YAML, then KVGATE_* env, then these flags; "
    "SIGHUP (or a change of the --config file) reloads them."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML settings file")
    parser.add_argument("--host", help="listen address (default 0.0.0.0)")
    parser.add_argument("--port", type=int, help="listen port (default 8000)")
    parser.add_argument(
        "--admin-port", type=int, help="admin listener port, on admin.host (default 8001)"
    )
    parser.add_argument(
        "--pod",
        action="append",
        dest="pods",
        metavar="NAME=URL[,events=tcp://H:P][,replay=tcp://H:P][,models=a|b]",
        help="an upstream pod; repeat for each pod",
    )
    parser.add_argument(
        "--strategy",
        help="routing strategy (round-robin, least-loaded, power-of-two, random, session, "
        "prefix-aware, kv-aware)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="processes serving the port, routing as one (default: one per core; 1: one process)",
    )
    parser.add_argument("--max-body-bytes", type=int, help="request body limit (default 8 MiB)")
    parser.add_argument("--log-level", help="debug, info, warning ...")


def run(args: argparse.Namespace) -> int:
    # Tokenize each request on the thread that asked (Rust, GIL released) rather than
    # fanning its ~2 KB calls out to a rayon pool: the pool's hand-off and idle spinning
    # cost more than they save on calls that small, and --workers forks N processes
    # that would each start one (`kvgate bench overhead`: docs/performance.md). An
    # operator's own setting wins.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from gateway.config import SettingsSource, parse_pod_flag
    from gateway.server import serve

    # SIGHUP reloads the settings once the gateway runs; until then it must not stop it.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    overrides: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "strategy": args.strategy,
        "max_body_bytes": args.max_body_bytes,
        "log_level": args.log_level,
        "workers": args.workers,
    }
    if args.admin_port is not None:
        overrides["admin"] = {"port": args.admin_port}
    if args.pods:
        overrides["pods"] = [parse_pod_flag(p) for p in args.pods]
    source = SettingsSource(args.config, {k: v for k, v in overrides.items() if v is not None})
    settings = source.load()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    serve(settings, source)
    return 0
