"""The HTTP applications: the serving app (the inference APIs of ``gateway.apis``,
health, readiness, metrics) and the admin app (``gateway.admin``), served on separate
listeners (``gateway.server``).

Handlers are module-level functions of the request; everything they use is the
``Gateway`` that ``gateway.state.running_gateway`` builds in the serving app's lifespan
and leaves on ``request.app.state.gw`` of both apps. Client credentials are checked
here, before a handler does any work; the proxy only forwards.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.admin import admin_routes
from gateway.admission import check_admission
from gateway.apis import APIS, error_style
from gateway.asgi import Message, Receive, Scope, Send, header_map, send_error
from gateway.auth import require_client_key
from gateway.config import Settings, SettingsSource
from gateway.errors import GatewayError
from gateway.http_limits import ClientConnections
from gateway.metrics import GatewayMetrics
from gateway.openai_body import Kind
from gateway.state import Gateway, build_routing, running_gateway
from gateway.workers import WorkerContext

log = logging.getLogger("kvgate.app")


def create_app(
    settings: Settings, worker: WorkerContext | None = None, source: SettingsSource | None = None
) -> FastAPI:
    """The serving app (its ``state.admin_app`` is the admin app); ``worker``: this
    process is one of ``kvgate serve --workers N``; ``source``: where ``settings`` came
    from, which a reload reads again (None: no reload)."""
    prometheus = CollectorRegistry()
    metrics = GatewayMetrics(prometheus)
    core = build_routing(settings)  # a bad strategy name or option fails here
    check_admission(settings)  # ... and a model's admission limits no policy takes

    admin = _bare_app()
    for route in admin_routes():
        admin.router.routes.append(route)
    admin.router.add_route("/metrics", metrics_endpoint, methods=["GET"])
    admin.router.add_route("/health", health, methods=["GET"])

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running_gateway(settings, core, prometheus, metrics, worker, source) as gw:
            app.state.gw = admin.state.gw = gw
            yield

    app = GatewayApp(lifespan)
    # The proxied endpoints are answered by GatewayApp before FastAPI sees them; these
    # routes only give other methods on those paths a 405.
    for api in APIS:
        app.router.add_route(api.path, _answered_by_gateway_app, methods=["POST"])
    app.router.add_route("/v1/models", list_models, methods=["GET"])
    app.router.add_route("/health", health, methods=["GET"])
    app.router.add_route("/ready", ready, methods=["GET"])
    if not settings.admin.metrics:
        app.router.add_route("/metrics", metrics_endpoint, methods=["GET"])
    app.state.admin_app = admin  # served on the admin listener by gateway.server
    # The serving listener's open connections, counted by gateway.server's protocol and
    # listed in /admin/bounds; one count for the process, as the listener is.
    admin.state.client_connections = app.state.client_connections = ClientConnections(
        settings.max_client_connections,
        on_refused=lambda: metrics.refused.labels("client_connections").inc(),
    )
    return app


def _bare_app(lifespan: Any = None) -> FastAPI:
    # No OpenAPI schema or docs: the routes take raw bodies, and a schema would only
    # advertise the surface.
    app = FastAPI(title="kvgate", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)  # fmt: skip
    app.add_exception_handler(GatewayError, _gateway_error)
    app.add_exception_handler(HTTPException, _http_error)
    return app


_FAST_ROUTES: dict[str, Kind] = {api.path: api.kind for api in APIS}


class GatewayApp(FastAPI):
    """The serving app. ``POST`` to a proxied path goes straight to the proxy in raw
    ASGI; FastAPI's middleware stack and Starlette's request and response objects cost
    more than the rest of the hot path together (docs/performance.md). Everything else
    (models, health, readiness, metrics, errors) is an ordinary FastAPI app."""

    def __init__(self, lifespan: Any) -> None:
        super().__init__(title="kvgate", lifespan=lifespan, openapi_url=None, docs_url=None,
                         redoc_url=None)  # fmt: skip
        self.add_exception_handler(GatewayError, _gateway_error)
        self.add_exception_handler(HTTPException, _http_error)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = _FAST_ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if kind is None or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        gw: Gateway = self.state.gw
        headers = header_map(scope)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            require_client_key(headers, gw.settings.api_keys)
            await gw.proxy.handle(scope, receive, tracked, kind, headers)
        except GatewayError as err:
            await send_error(send, err, {}, error_style(kind))
        except RecursionError:
            # msgspec parses bodies nested up to Python's recursion limit, and what routing
            # walks recursively (hashing content parts, a session key) may then pass it:
            # the body's nesting, not the gateway, is at fault.
            if not started:
                error = GatewayError(400, "request body is nested too deeply",
                                     code="invalid_request")  # fmt: skip
                await send_error(send, error, {}, error_style(kind))
        except Exception:
            log.exception("unhandled error answering %s", scope["path"])
            if not started:
                error = GatewayError(500, "internal error in the gateway")
                await send_error(send, error, {}, error_style(kind))


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gw


async def _answered_by_gateway_app(request: Request) -> Response:
    """Never called: ``GatewayApp`` answers POST to proxied paths before routing."""
    raise GatewayError(500, "proxied route reached FastAPI routing")


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the models of the healthy pods, merged."""
    gw = gateway_of(request)
    require_client_key(request.headers, gw.settings.api_keys)
    cards: dict[str, dict[str, object]] = {}
    for pod in gw.registry.all():
        if not pod.healthy:
            continue
        for model in sorted(pod.models):
            cards.setdefault(model, pod.model_cards.get(model) or _card(model))
    return JSONResponse({"object": "list", "data": list(cards.values())})


async def health(request: Request) -> Response:
    """The process is alive (liveness)."""
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Every configured model has a healthy pod, and the index knows what the start-up
    pods hold (warm start, ``gateway.warm_start``): readiness."""
    gw = gateway_of(request)
    configured = {m for p in gw.settings.pods for m in p.models} or gw.registry.known_models()
    serving = gw.registry.serving_models()
    missing = sorted(configured - serving)
    if not serving or missing:
        body = {"status": "not ready", "models_without_healthy_pod": missing}
        return JSONResponse(body, status_code=503)
    if warming := gw.scale.warm.warming():
        body = {"status": "warming", "pods_replaying_kv_events": warming}
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ready", "models": sorted(serving), **gw.scale.describe()})


async def metrics_endpoint(request: Request) -> Response:
    """Prometheus exposition of the gateway's own registry."""
    return Response(generate_latest(gateway_of(request).exposition), media_type=CONTENT_TYPE_LATEST)


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (unknown path or method) in the OpenAI error shape."""
    assert isinstance(exc, HTTPException)
    return GatewayError(exc.status_code, str(exc.detail)).response(exc.headers)


def _card(model: str) -> dict[str, object]:
    return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "kvgate"}
