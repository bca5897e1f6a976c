"""``kvgate serve``: run the gateway in front of vLLM pods."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.config import PodConfig, Settings, SettingsSource

# What reading and checking the settings raises for a bad value, file or flag (pydantic's
# and pydantic-settings' errors are ValueErrors; a YAML error is its own; a strategy's
# options may raise TypeError); anything else is a bug and keeps its traceback.
SETTINGS_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError)

# A listener that cannot be had: the port taken, the address not this host's, a
# privileged port, a host name that does not resolve.
LISTEN_ERRNOS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)

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
    import yaml

    from gateway.logs import set_log_level
    from gateway.reload import describe_error

    # SIGHUP reloads the settings once the gateway runs; until then it must not stop it.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        source, settings = _settings(args)
    except (*SETTINGS_ERRORS, yaml.YAMLError) as exc:
        # One line naming the setting, never a traceback (nor a value: keys are settings).
        reason = str(exc) if isinstance(exc, FlagError) else describe_error(exc)
        print(f"kvgate serve: invalid settings: {reason}", file=sys.stderr)
        return 2
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s %(message)s")
    set_log_level(settings.log_level)
    return _serve(settings, source)


def _serve(settings: Settings, source: SettingsSource) -> int:
    from gateway.server import serve

    try:
        serve(settings, source)
    except OSError as exc:
        if not isinstance(exc, socket.gaierror) and exc.errno not in LISTEN_ERRNOS:
            raise
        listeners = f"{settings.host}:{settings.port}"
        if settings.admin.port is not None:
            listeners += f" and admin {settings.admin.host}:{settings.admin.port}"
        print(f"kvgate serve: cannot listen on {listeners}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


def _settings(args: argparse.Namespace) -> tuple[SettingsSource, Settings]:
    """The settings from the file, the environment and the flags, checked as start-up
    will use them (strategies built, admission policies made)."""
    from gateway.config import SettingsSource
    from gateway.reload import preflight

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
        overrides["pods"] = [_pod(p) for p in args.pods]
    source = SettingsSource(args.config, {k: v for k, v in overrides.items() if v is not None})
    settings = source.load()
    preflight(settings)
    return source, settings


def _pod(spec: str) -> PodConfig:
    """One ``--pod`` flag; an error names the flag it came from."""
    import pydantic

    from gateway.config import parse_pod_flag
    from gateway.reload import describe_error

    try:
        return parse_pod_flag(spec)
    except ValueError as exc:
        # The flag by its NAME=URL head: the options after it may hold keys.
        reason = describe_error(exc) if isinstance(exc, pydantic.ValidationError) else str(exc)
        raise FlagError(f"--pod {spec.split(',')[0]}: {reason}") from None


class FlagError(ValueError):
    """A command-line flag that is not valid; the message names it."""
