"""The composition root: everything one gateway process owns, built and torn down here.

``running_gateway`` wires the pieces together in one place (the HTTP client, pod
registry, KV index, routing core, proxy, discovery, and what makes the process one
router among several worker processes or replicas: ``gateway.scale_out``) and owns
their start and stop order; handlers reach the result as ``request.app.state.gw``.
Nothing here serves HTTP: ``gateway.app`` (OpenAI endpoints) and ``gateway.admin``
(operator endpoints) are built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry

from gateway.admission import Admission, AdmissionMetrics
from gateway.config import Settings
from gateway.discovery import DiscoveryMetrics, PodDiscovery, RegistrySink
from gateway.kv import KvIndex
from gateway.loop_lag import LoopLagMonitor
from gateway.metrics import GatewayMetrics
from gateway.pods import PodRegistry
from gateway.proxy import Proxy
from gateway.router import Router
from gateway.scale_out import ScaleOut, scale_out
from gateway.tracing import Tracing
from gateway.upstream import Upstream
from gateway.workers import WorkerContext
from routing.core import RoutingCore


@dataclass
class Gateway:
    """Everything one gateway process owns; built by ``running_gateway``."""

    settings: Settings
    registry: PodRegistry
    router: Router
    proxy: Proxy
    metrics: GatewayMetrics
    prometheus: CollectorRegistry
    client: httpx.AsyncClient
    kv: KvIndex
    scale: ScaleOut
    # What /metrics renders: ``prometheus`` itself, or with workers every worker's
    # metrics summed (Prometheus's multiprocess mode).
    exposition: CollectorRegistry
    admission: Admission | None = None  # admission.enabled


def build_routing(settings: Settings) -> RoutingCore:
    """The strategies from config; an unknown name or bad option fails here, at start-up."""
    return RoutingCore.from_config(
        settings.strategy, settings.strategy_options, settings.model_strategies
    )


@contextlib.asynccontextmanager
async def running_gateway(
    settings: Settings,
    core: RoutingCore,
    prometheus: CollectorRegistry,
    metrics: GatewayMetrics,
    worker: WorkerContext | None = None,
) -> AsyncIterator[Gateway]:
    """Build, start, yield, and stop one gateway: the order of both lives here.

    Requests to pods go through ``Upstream`` (aiohttp, the hot path); health probes,
    engine ``/tokenize`` calls and discovery use the httpx ``client``. ``worker``: this
    process is one of ``kvgate serve --workers N`` (``gateway.workers``)."""
    limits = httpx.Limits(
        max_connections=settings.max_upstream_connections,
        max_keepalive_connections=settings.max_upstream_connections,
        keepalive_expiry=30,
    )
    upstream = Upstream(settings.max_upstream_connections, settings.timeouts.connect_s)
    await upstream.start()
    async with httpx.AsyncClient(limits=limits, timeout=settings.timeouts.total_s) as client:
        registry = PodRegistry(settings.pods, client, settings.health, metrics, settings.lora)
        kv = KvIndex(settings, prometheus, client, worker is None or worker.writes_shared_events)
        core.set_speculation(kv.speculate)
        scale = scale_out(settings, core, kv, registry, prometheus, worker)  # load view first
        registry.on_admit(kv.pod_admitted)
        registry.on_eject(kv.pod_ejected)
        registry.on_remove(kv.pod_removed)
        registry.on_remove(core.load.forget)
        registry.on_remove(metrics.forget_pod)
        router = Router(core, metrics, kv, settings.session_header, settings.session_body_field)
        admission = None
        if settings.admission.enabled:
            admission = Admission(settings.admission, settings.models, router,
                                  AdmissionMetrics(prometheus))  # fmt: skip
            registry.on_admit(admission.pod_admitted)
        tracing = Tracing(settings.tracing) if settings.tracing.enabled else None
        proxy = Proxy(settings, upstream, registry, router, metrics, admission, tracing)
        exposition = prometheus
        if worker is not None:
            from prometheus_client import multiprocess

            exposition = CollectorRegistry()
            multiprocess.MultiProcessCollector(exposition, path=worker.metrics_dir)
        gw = Gateway(settings, registry, router, proxy, metrics, prometheus, client, kv, scale,
                     exposition, admission)  # fmt: skip
        await kv.warm_up(m for m in settings.models if router.uses_index(m))
        await registry.start()
        await scale.start()
        discovery = None
        if settings.discovery.enabled:  # pods come and go with Kubernetes readiness
            discovery = PodDiscovery(
                settings.discovery, RegistrySink(registry), DiscoveryMetrics(prometheus)
            )
            await discovery.start()
        loop_lag = LoopLagMonitor(prometheus)
        loop_lag.start()
        try:
            yield gw
        finally:
            if discovery is not None:
                await discovery.stop()
            await registry.stop()
            await scale.stop()
            await kv.close()
            await upstream.close()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # exports what is buffered
            await loop_lag.stop()
