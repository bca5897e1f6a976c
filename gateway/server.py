"""Serving the gateway: one uvicorn server, two listeners (serving and admin).

The serving app and the admin app share one ``Gateway`` (the serving app's lifespan
builds it). Both sockets belong to one uvicorn server, which hands each connection to
``ByListener``: a request that arrived on the admin socket goes to the admin app, any
other to the serving app. So nothing a client sends to the serving port can reach an
admin route, whatever its path or headers.

With ``workers`` > 1 (``kvgate serve --workers N``) the supervisor in
``gateway.workers`` forks N such servers: each has its own ``SO_REUSEPORT`` serving
socket and all serve the one admin socket; every response carries
``x-kvgate-worker`` (which worker answered). ``workers`` 1 is the single process
exactly as without it.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.config import Settings, SettingsSource
from gateway.http_limits import ClientConnections, guarded_protocol
from gateway.multiprocess_values import BatchedValues, use_batched_values
from gateway.reload import SIGHUPS, latest_settings
from gateway.workers import Supervisor, WorkerContext, default_workers, reuseport_socket

log = logging.getLogger("kvgate.server")

ASGIApp = Any  # (scope, receive, send) -> awaitable


class ByListener:
    """ASGI app: requests on ``admin_port`` go to ``admin``, everything else to ``serving``
    (including the lifespan, which the serving app owns)."""

    def __init__(self, serving: ASGIApp, admin: ASGIApp, admin_port: int | None) -> None:
        self.serving = serving
        self.admin = admin
        self.admin_port = admin_port

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        server = scope.get("server")
        if self.admin_port is not None and server and server[1] == self.admin_port:
            if scope["type"] != "lifespan":
                await self.admin(scope, receive, send)
                return
        await self.serving(scope, receive, send)


def bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket for ``host:port`` (IPv4 or IPv6), ready for uvicorn."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.set_inheritable(True)
    return sock


def uvicorn_config(
    settings: Settings,
    app: ASGIApp,
    connections: ClientConnections | None = None,
    admin_port: int | None = None,
) -> uvicorn.Config:
    """``connections``: the serving listener's (every listener's but ``admin_port``)."""
    protocol = guarded_protocol(
        settings.max_header_bytes, settings.timeouts.client_headers_s, connections, admin_port
    )
    return uvicorn.Config(
        app,
        loop="uvloop",
        http=protocol,
        log_level=settings.log_level.lower(),
        access_log=False,
        lifespan="on",
        # Nothing per request that the gateway does not use: no X-Forwarded-* rewriting
        # of the client address (it is never read), no Server header.
        proxy_headers=False,
        server_header=False,
    )


class WorkerHeader:
    """ASGI app: ``app``, with ``x-kvgate-worker: <index>`` on every HTTP response."""

    def __init__(self, app: ASGIApp, index: int) -> None:
        self.app = app
        self.header = (b"x-kvgate-worker", str(index).encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


def serve(settings: Settings, source: SettingsSource | None = None) -> None:
    """Run the gateway until SIGINT/SIGTERM: one process, or a supervisor and its
    ``settings.workers`` worker processes (None: one per core). ``source``: where
    ``settings`` came from; SIGHUP reloads from it (``gateway.reload``)."""
    count = settings.workers if settings.workers is not None else default_workers()
    if count > 1:
        serve_workers(settings, count, source)
        return
    reload_on_sighup()
    serving = create_app(settings, source=source)
    sockets = [bind(settings.host, settings.port)]
    admin_port = None
    if settings.admin.port is not None:
        sockets.append(bind(settings.admin.host, settings.admin.port))
        admin_port = sockets[-1].getsockname()[1]
    app = ByListener(serving, serving.state.admin_app, admin_port)
    raise_open_files_limit(settings)
    config = uvicorn_config(settings, app, serving.state.client_connections, admin_port)
    uvicorn.Server(config).run(sockets=sockets)


def serve_workers(settings: Settings, count: int, source: SettingsSource | None = None) -> None:
    """The supervisor: reserve the ports, fork ``count`` workers, run until a signal
    (SIGHUP: every worker reloads its settings)."""
    reserved = reuseport_socket(settings.host, settings.port, listen=False)
    port = reserved.getsockname()[1]
    admin_sock, admin_port = None, None
    if settings.admin.port is not None:
        admin_sock = bind(settings.admin.host, settings.admin.port)
        admin_port = admin_sock.getsockname()[1]

    def run_worker(ctx: WorkerContext) -> int:
        reserved.close()
        metric_values = use_multiprocess_metrics(ctx.metrics_dir)
        # Bound, not listening: uvicorn's server listens once the app has started. A
        # listening socket joins the port's group at once, and the kernel would queue
        # a share of new connections on it for the whole startup (a worker restarted
        # while its siblings serve took ~1.8 s on a 2-core VM).
        sockets = [reuseport_socket(settings.host, port, listen=False)]
        if admin_sock is not None:
            sockets.append(admin_sock)
        reload_on_sighup()  # before the settings are read: a SIGHUP from here on counts
        # A worker restarted after a reload runs what its siblings reloaded.
        serving = create_app(latest_settings(source, settings), ctx, source)
        app = WorkerHeader(ByListener(serving, serving.state.admin_app, admin_port), ctx.index)
        config = uvicorn_config(settings, app, serving.state.client_connections, admin_port)
        try:
            uvicorn.Server(config).run(sockets=sockets)
        finally:
            metric_values.flush()  # the worker leaves by os._exit: no atexit runs
        return 0

    raise_open_files_limit(settings)  # inherited by the workers
    so = settings.scale_out
    supervisor = Supervisor(
        count, run_worker, load_capacity=so.worker_load_pods, bus_bytes=so.worker_bus_bytes
    )
    log.info("kvgate: %d workers on port %d", count, port)
    code = supervisor.run()
    reserved.close()
    if code:
        raise SystemExit(code)


# Descriptors a process needs beside its client and pod connections: the listeners,
# event subscriptions, Redis, health probes, log and metric files.
OTHER_FILES = 256


def raise_open_files_limit(settings: Settings) -> int:
    """Raise this process's soft open-files limit to fit ``max_client_connections``
    and ``max_upstream_connections`` (many systems start processes at 1,024), as far as
    the hard limit allows; returns the soft limit now. A limit that stays below is
    logged: the connection bounds cannot all be reached before ``accept`` fails."""
    needed = settings.max_client_connections + settings.max_upstream_connections + OTHER_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "kvgate: open files limited to %d (hard limit), below the %d that "
            "max_client_connections + max_upstream_connections need; lower them or "
            "raise the limit (ulimit -n)", soft, needed,
        )  # fmt: skip
    return soft


def reload_on_sighup() -> None:
    """SIGHUP reloads the settings of this process's gateway; it never stops the
    process. One that arrives before the gateway runs (its settings read, its
    tokenizers still warming) is kept, and acted on once it runs (``SIGHUPS``)."""

    def on_sighup(signum: int, frame: object) -> None:
        SIGHUPS.received()

    signal.signal(signal.SIGHUP, on_sighup)


def use_multiprocess_metrics(directory: str) -> BatchedValues:
    """Metrics created from now on write to a file per process in ``directory``
    (Prometheus's multiprocess mode), so ``/metrics`` on any worker sums them all. They
    reach it in batches: the caller flushes (``gateway.multiprocess_values``)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    # Every update checks for a fork by calling the process identifier: os.getpid(), a
    # system call, was a third of an update's ~0.75 µs. The pid is read once instead,
    # and again in a forked child.
    return use_batched_values(directory, _this_pid)


_pid = os.getpid()


def _this_pid() -> int:
    return _pid


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)
