"""What changed between two ``Settings``, and which of it a running gateway can take.

Most settings are read per request or per probe and change with a reload
(``gateway.reload``). The ones below shape what is built once at start-up (sockets,
the index store, shared memory, the connection pool, the exporter), so a reload
leaves them as they are and says they need a restart. Changes are named by dotted
path (``timeouts.total_s``, ``models.<model>.block_size``, ``pods[<name>]``), never
by value: keys and secrets change too.
"""

from __future__ import annotations

from typing import Any

from gateway.config import Settings

# Dotted paths (a section: everything in it) that only a restart changes.
RESTART_ONLY: tuple[str, ...] = (
    "host",
    "port",
    "workers",
    "admin.host",
    "admin.port",
    "admin.metrics",  # which listener serves /metrics: routes are set at start-up
    "index",  # the store (memory or Redis, its URL and bounds) and the event maps
    "scale_out",  # the workers' shared memory and the replicas' load exchange
    "discovery",  # the Kubernetes watch
    "tracing",  # the OpenTelemetry provider and exporter
    "max_upstream_connections",  # the connection pool to the pods
    "timeouts.connect_s",  # ... and its connect timeout
    "max_header_bytes",  # the HTTP protocol of the listeners
    "max_client_connections",
    "timeouts.client_headers_s",
)


def changed_paths(old: Settings, new: Settings) -> list[str]:
    """Every setting that differs, by dotted path, sorted; pods by name."""
    a, b = old.model_dump(), new.model_dump()
    paths = _diff(a, b, "", skip={"pods"})
    old_pods = {p["name"]: p for p in a["pods"]}
    new_pods = {p["name"]: p for p in b["pods"]}
    for name in old_pods.keys() | new_pods.keys():
        if old_pods.get(name) != new_pods.get(name):
            paths.append(f"pods[{name}]")
    return sorted(paths)


def needs_restart(path: str) -> bool:
    return any(path == r or path.startswith(r + ".") for r in RESTART_ONLY)


def runtime_settings(running: Settings, new: Settings) -> Settings:
    """``new`` with the restart-only settings of ``running``: what a reload applies.

    Validated again as a whole, so a combination neither file asked for (say the
    running admin address without the admin keys the new file dropped) is refused
    like a bad file (``pydantic.ValidationError``)."""
    data, kept = new.model_dump(), running.model_dump()
    for path in RESTART_ONLY:
        *parents, leaf = path.split(".")
        into, source = data, kept
        for part in parents:
            into, source = into[part], source[part]
        into[leaf] = source[leaf]
    # Every field is given, so no environment variable or file fills one in.
    return Settings(**data)


def _diff(a: Any, b: Any, prefix: str, skip: set[str] | None = None) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in a.keys() | b.keys():
            if skip and key in skip:
                continue
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in a or key not in b:
                out.append(path)
            else:
                out += _diff(a[key], b[key], path)
        return out
    return [] if a == b else [prefix]
