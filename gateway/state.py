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
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from gateway import heap
from gateway.admission import Admission, AdmissionMetrics
from gateway.awaiting import AwaitingPods
from gateway.config import PodConfig, Settings, SettingsSource
from gateway.discovery import DiscoveryMetrics, PodDiscovery, RegistrySink
from gateway.in_flight import InFlightBounds
from gateway.kv import KvIndex
from gateway.logs import set_log_level
from gateway.loop_lag import LoopLagMonitor
from gateway.metrics import FleetSeries, GatewayMetrics
from gateway.multiprocess_values import FlushedFirst, batched_values
from gateway.pods import PodRegistry, same_endpoints
from gateway.proxy import Proxy
from gateway.reload import Reloader, ReloadMetrics
from gateway.router import Router
from gateway.scale_out import ScaleOut, scale_out
from gateway.tracing import Tracing
from gateway.upstream import Upstream
from gateway.workers import WorkerContext
from routing.core import RoutingCore
from routing.strategy_set import StrategySet
from routing.types import Need


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
    upstream: Upstream
    in_flight: InFlightBounds  # requests being served and their bodies' bytes, across reloads
    admission: Admission | None = None  # admission.enabled
    tracing: Tracing | None = None  # tracing.enabled
    reloader: Reloader | None = None  # None: no settings source to reload from
    # Built once admission control was first enabled, and kept while it is off again
    # (its metrics are registered once; waiters left when it was switched off drain).
    admission_control: Admission | None = None
    # Requests waiting on pods, given up when their pod is lost (``gateway.awaiting``).
    awaiting: AwaitingPods | None = None

    async def reconfigure(self, new: Settings, strategies: StrategySet) -> None:
        """Run with ``new`` settings from now on (``gateway.reload`` validated them, and
        built ``strategies``, and kept the restart-only settings as they are).

        What takes time comes first and changes nothing (new tokenizers load in a
        thread); then every part takes its new settings with no await in between, so a
        request sees the old configuration or the new one whole; then the pods that
        left, came or changed are applied, and re-keyed pods' events followed anew.
        A request in flight keeps the proxy, settings and strategy it started with;
        the load view, and with it the counts of requests in flight, stays."""
        uses_index = [m for m in new.models if Need.INDEX in strategies.for_model(m).needs]
        tokenizers = await self.kv.load_tokenizers(new, uses_index)
        old, self.settings = self.settings, new
        self.router.core.use_strategies(strategies)
        self.router.set_session_source(new.session_header, new.session_body_field)
        self.registry.configure(new.health, new.lora)
        refollow = self.kv.use_settings(new, tokenizers)
        self.admission = self._admission_for(new)
        self.proxy = Proxy(new, self.upstream, self.registry, self.router, self.metrics,
                           self.in_flight, self.admission, self.tracing,
                           self.awaiting)  # fmt: skip
        if new.log_level != old.log_level:
            set_log_level(new.log_level)
        await self._apply_pods(old.pods, new.pods)
        await self.kv.refollow([p for name in refollow if (p := self.registry.get(name))])

    def _admission_for(self, new: Settings) -> Admission | None:
        built = self.admission_control
        if new.admission.enabled:
            if built is None:
                built = Admission(new.admission, new.models, self.router,
                                  AdmissionMetrics(self.prometheus))  # fmt: skip
                self.registry.on_admit(built.pod_admitted)
                self.registry.on_models_gone(built.models_gone)
                self.admission_control = built
            else:
                built.reconfigure(new.admission, new.models)
            return built
        if built is not None:
            built.release_all()
        return None

    async def _apply_pods(self, old: list[PodConfig], new: list[PodConfig]) -> None:
        """Configured pods that left go, new ones are probed (and admitted at once if
        they answer), like discovery's. A pod at the same address and event endpoints
        with other keys or models keeps its health, load and index entries; one whose
        address or endpoints changed is another pod to routing."""
        before, after = {p.name: p for p in old}, {p.name: p for p in new}
        sink = RegistrySink(self.registry)
        joining = []
        for name, cfg in after.items():
            was = before.get(name)
            if was == cfg:
                continue
            if was is not None and same_endpoints(was, cfg) and self.registry.update(cfg):
                continue
            joining.append(sink.upsert(cfg))
        await asyncio.gather(*joining)  # new pods in rotation first: a swap never leaves none
        for name in before.keys() - after.keys():
            await sink.remove(name)


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
    source: SettingsSource | None = None,
) -> AsyncIterator[Gateway]:
    """Build, start, yield, and stop one gateway: the order of both lives here.

    Requests to pods go through ``Upstream`` (``gateway.upstream``'s own client, the hot
    path); health probes,
    engine ``/tokenize`` calls and discovery use the httpx ``client``. ``worker``: this
    process is one of ``kvgate serve --workers N`` (``gateway.workers``). ``source``:
    where its settings came from; with one, SIGHUP, ``POST /admin/reload`` and a
    change of the config file reload them (``gateway.reload``)."""
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
        if settings.index.speculative_ttl_s > 0:  # 0: no speculative entries at all
            core.set_speculation(kv.speculate)
        core.set_occupancy(kv.l0_blocks_now)
        scale = scale_out(settings, core, kv, registry, prometheus, worker)  # load view first
        registry.on_admit(kv.pod_admitted)
        registry.on_eject(kv.pod_ejected)
        registry.on_remove(kv.pod_removed)
        registry.on_remove(core.forget_pod)  # the load view in use then, and strategies
        registry.on_remove(metrics.forget_pod)
        # Adapters come and go: a model no pod serves takes its series and state with it.
        registry.on_models_gone(lambda gone: metrics.forget_models(gone, registry.known_models()))
        registry.on_models_gone(lambda gone: kv.forget_models(gone, registry.known_models()))
        router = Router(core, metrics, kv, settings.session_header, settings.session_body_field)
        if scale.siblings is not None:
            router.before_route, router.on_routed = scale.siblings.drain, scale.siblings.routed
        router.fresh_load = scale.load_reader()
        admission = None
        if settings.admission.enabled:
            admission = Admission(settings.admission, settings.models, router,
                                  AdmissionMetrics(prometheus))  # fmt: skip
            registry.on_admit(admission.pod_admitted)
            registry.on_models_gone(admission.models_gone)
        tracing = Tracing(settings.tracing) if settings.tracing.enabled else None
        in_flight = InFlightBounds(lambda bound: metrics.refused.labels(bound).inc())
        awaiting = AwaitingPods()  # what a lost pod gives up, across reloads
        registry.on_lost(awaiting.pod_lost)
        proxy = Proxy(settings, upstream, registry, router, metrics, in_flight, admission,
                      tracing, awaiting)  # fmt: skip
        exposition = prometheus
        batched = batched_values() if worker is not None else None
        if worker is not None:
            from prometheus_client import multiprocess

            exposition = CollectorRegistry()
            files: Any = multiprocess.MultiProcessCollector(None, path=worker.metrics_dir)
            if batched is not None:
                files = FlushedFirst(files, batched.flush)
            pods = registry.all
            exposition.register(
                FleetSeries(files, lambda: (p.name for p in pods()), registry.known_models)
            )
        gw = Gateway(settings, registry, router, proxy, metrics, prometheus, client, kv, scale,
                     exposition, upstream, in_flight, admission, tracing,
                     admission_control=admission, awaiting=awaiting)  # fmt: skip
        if source is not None:
            gw.reloader = Reloader(gw, source, ReloadMetrics(prometheus))
        await kv.warm_up(m for m in settings.models if router.uses_index(m))
        await registry.start()
        await scale.start()
        discovery = None
        if settings.discovery.enabled:  # pods come and go with Kubernetes readiness
            discovery = PodDiscovery(
                settings.discovery, RegistrySink(registry), DiscoveryMetrics(prometheus)
            )
            await discovery.start()
        if gw.reloader is not None:
            await gw.reloader.start()
        loop_lag = LoopLagMonitor(prometheus)
        loop_lag.start()
        gc_pauses = heap.GcPauses(prometheus)
        gc_pauses.start()
        heap.settle()  # what start-up built lives as long as the gateway
        flushing = asyncio.create_task(batched.run()) if batched is not None else None
        try:
            yield gw
        finally:
            if gw.reloader is not None:
                await gw.reloader.stop()
            if discovery is not None:
                await discovery.stop()
            await registry.stop()
            await scale.stop()
            await kv.close()
            await upstream.close()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # exports what is buffered
            await loop_lag.stop()
            await gc_pauses.stop()
            if flushing is not None:
                flushing.cancel()  # and flushes once more
                with contextlib.suppress(asyncio.CancelledError):
                    await flushing
