"""Serving the gateway: one uvicorn server, two listeners (serving and admin).

The serving app and the admin app share one ``Gateway`` (the serving app's lifespan
builds it). Both sockets belong to one uvicorn server, which hands each connection to
``ByListener``: a request that arrived on the admin socket goes to the admin app, any
other to the serving app. So nothing a client sends to the serving port can reach an
admin route, whatever its path or headers.
"""

from __future__ import annotations

import socket
from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.config import Settings
from gateway.http_limits import guarded_protocol

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


def uvicorn_config(settings: Settings, app: ASGIApp) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        loop="uvloop",
        http=guarded_protocol(settings.max_header_bytes, settings.timeouts.client_headers_s),
        log_level=settings.log_level.lower(),
        access_log=False,
        lifespan="on",
        # Nothing per request that the gateway does not use: no X-Forwarded-* rewriting
        # of the client address (it is never read), no Server header.
        proxy_headers=False,
        server_header=False,
    )


def serve(settings: Settings) -> None:
    """Run the gateway until SIGINT/SIGTERM."""
    serving = create_app(settings)
    sockets = [bind(settings.host, settings.port)]
    admin_port = None
    if settings.admin.port is not None:
        sockets.append(bind(settings.admin.host, settings.admin.port))
        admin_port = sockets[-1].getsockname()[1]
    app = ByListener(serving, serving.state.admin_app, admin_port)
    uvicorn.Server(uvicorn_config(settings, app)).run(sockets=sockets)
