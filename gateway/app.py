"""The FastAPI application: OpenAI endpoints, health, readiness, metrics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import JSONResponse, Response

from gateway.admin import add_admin_routes
from gateway.config import Settings
from gateway.discovery import DiscoveryMetrics, PodDiscovery, RegistrySink
from gateway.errors import GatewayError
from gateway.kv import KvIndex
from gateway.metrics import GatewayMetrics
from gateway.openai_body import Kind
from gateway.proxy import Proxy
from gateway.registry import PodRegistry
from gateway.router import Router
from routing.load import LoadTracker
from routing.registry import canonical_name


@dataclass
class Gateway:
    """Everything one gateway process owns; built in the app's lifespan."""

    settings: Settings
    registry: PodRegistry
    router: Router
    proxy: Proxy
    metrics: GatewayMetrics
    prometheus: CollectorRegistry
    client: httpx.AsyncClient
    kv: KvIndex


def create_app(settings: Settings) -> FastAPI:
    prometheus = CollectorRegistry()
    metrics = GatewayMetrics(prometheus)
    load = LoadTracker()
    for name in [settings.strategy, *settings.model_strategies.values()]:
        canonical_name(name)  # fail at start-up, not on the first request

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(
            max_connections=settings.max_upstream_connections,
            max_keepalive_connections=settings.max_upstream_connections,
            keepalive_expiry=30,
        )
        async with httpx.AsyncClient(limits=limits, timeout=settings.timeouts.total_s) as client:
            registry = PodRegistry(settings.pods, client, settings.health, metrics)
            kv = KvIndex(settings, prometheus, client)
            registry.on_admit(kv.pod_admitted)
            registry.on_eject(kv.pod_ejected)
            router = Router(
                settings.strategy,
                metrics,
                load,
                strategy_options=settings.strategy_options,
                model_strategies=settings.model_strategies,
                kv=kv,
                session_header=settings.session_header,
                session_body_field=settings.session_body_field,
            )
            proxy = Proxy(settings, client, registry, router, load, metrics, kv)
            app.state.gw = Gateway(
                settings, registry, router, proxy, metrics, prometheus, client, kv
            )
            await kv.warm_up(m for m in settings.models if router.uses_index(m))
            await registry.start()
            discovery = None
            if settings.discovery.enabled:  # pods come and go with Kubernetes readiness
                sink = RegistrySink(registry, kv)
                discovery = PodDiscovery(settings.discovery, sink, DiscoveryMetrics(prometheus))
                await discovery.start()
            try:
                yield
            finally:
                if discovery is not None:
                    await discovery.stop()
                await registry.stop()
                await kv.close()

    app = FastAPI(title="kvgate", lifespan=lifespan, docs_url=None, redoc_url=None)

    def gw(request: Request) -> Gateway:
        return request.app.state.gw

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return GatewayError(400, str(exc)).response()

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        return exc.response()

    # The proxied endpoints are plain Starlette routes: they take the raw request and
    # need none of FastAPI's parameter resolution, which costs time on the hot path.
    for path, kind in (
        ("/v1/chat/completions", "chat"),
        ("/v1/completions", "completions"),
        ("/v1/embeddings", "embeddings"),
        ("/tokenize", "tokenize"),
        ("/detokenize", "detokenize"),
    ):
        app.router.add_route(path, _proxied(kind), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        g = gw(request)
        g.proxy.check_auth(request)
        cards: dict[str, dict[str, object]] = {}
        for pod in g.registry.all():
            if not pod.healthy:
                continue
            for model in sorted(pod.models):
                cards.setdefault(model, pod.model_cards.get(model) or _card(model))
        return JSONResponse({"object": "list", "data": list(cards.values())})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        g = gw(request)
        configured = {m for p in g.settings.pods for m in p.models} or g.registry.known_models()
        serving = g.registry.serving_models()
        missing = sorted(configured - serving)
        if not serving or missing:
            body = {"status": "not ready", "models_without_healthy_pod": missing}
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ready", "models": sorted(serving)})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(prometheus), media_type=CONTENT_TYPE_LATEST)

    add_admin_routes(app, gw)
    return app


def _proxied(kind: Kind) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await request.app.state.gw.proxy.handle(request, kind)

    endpoint.__name__ = kind
    return endpoint


def _card(model: str) -> dict[str, object]:
    return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "kvgate"}
