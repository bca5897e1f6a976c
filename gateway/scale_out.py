"""What makes one gateway process one router among several (wired by ``gateway.state``).

* ``--workers N`` (``worker`` given): load is counted in and read from the host's
  shared table (``gateway.host_load``); speculation (memory index) and posted KV
  events go to the sibling workers (``gateway.siblings``); worker 0 alone writes KV
  events to a Redis index and exchanges the host's load with the other replicas.
* a Redis index with ``scale_out.share_load``: the replica's in-flight counts are
  exchanged with every other replica's (``gateway.fleet_load``) and routing adds the
  others' to its own; a request that finds them stale has them read again beside its
  index lookup (``load_reader``, for the router).
* a Redis index with ``scale_out.share_calibration``: kv-aware's calibration points
  are pooled with every other process's, so each fits from the fleet's requests, not
  its share of them (``gateway.fleet_calibration``).
* warm start (``gateway.warm_start``): ``/ready`` waits until the start-up pods'
  event history has been replayed (memory index).

A single process with the memory index (the default ``kvgate serve --workers 1``)
gets none of it but the warm start: its load view stays the routing core's own
``LoadTracker``.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from gateway.config import Settings
from gateway.kv import KvIndex
from gateway.pods import PodRegistry
from gateway.siblings import SiblingMetrics, Siblings
from gateway.warm_start import WarmStart
from gateway.workers import WorkerContext
from kvindex.types import Bound
from routing.core import RoutingCore
from routing.load import CombinedLoad

if TYPE_CHECKING:  # imported when Redis is in use: redis-py pulls in OpenTelemetry's SDK
    from gateway.fleet_calibration import CalibrationExchange
    from gateway.fleet_load import FleetLoadExchange
    from kvindex.redis_store import RedisStore
    from routing.calibration import Calibrator
    from routing.strategies.kv_aware import KvAware


@dataclass
class ScaleOut:
    """This process's part in a scaled-out router; ``describe`` is for ``/ready``."""

    warm: WarmStart
    worker: WorkerContext | None = None
    siblings: Siblings | None = None
    exchange: FleetLoadExchange | None = None
    calibration: CalibrationExchange | None = None
    # The client both exchanges use (a Redis index only); closed once, after them.
    redis: RedisStore | None = None

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {"index": self.warm.state}
        if self.worker is not None:
            out["worker"] = f"{self.worker.index + 1}/{self.worker.count}"
        if self.exchange is not None:
            out["replicas_sharing_load"] = self.exchange.replicas + 1
        return out

    def load_reader(self) -> Callable[[], asyncio.Future[None] | None] | None:
        """The router's hook before a request's index lookup (``Router.fresh_load``):
        the exchange's ``fresh``, whose future, awaited after the lookup, has the other
        replicas' counts fresh. None where nobody shares them, or on a ``--workers``
        host, whose worker 0 exchanges on its own clock. Decided once, at wiring."""
        if self.exchange is None or self.worker is not None:
            return None
        return self.exchange.fresh

    def bounds(self) -> dict[str, Bound]:
        return self.siblings.bounds() if self.siblings is not None else {}

    async def start(self) -> None:
        if self.siblings is not None:
            await self.siblings.start()
        if self.exchange is not None:
            await self.exchange.start()
        if self.calibration is not None:
            await self.calibration.start()

    async def stop(self) -> None:
        if self.calibration is not None:
            await self.calibration.stop()
        if self.exchange is not None:
            await self.exchange.stop()
        if self.redis is not None:
            await self.redis.close()
        if self.siblings is not None:
            await self.siblings.stop()


def scale_out(
    settings: Settings,
    core: RoutingCore,
    kv: KvIndex,
    registry: PodRegistry,
    prometheus: CollectorRegistry,
    worker: WorkerContext | None,
) -> ScaleOut:
    """Plug the shared load view and the siblings into ``core`` and ``kv``."""
    so = settings.scale_out
    shared_index = settings.index.backend == "redis"
    out = ScaleOut(WarmStart(kv, shared_index), worker)
    sink = None
    own = None
    if worker is not None:
        table = worker.load
        core.set_load(table.view(worker.index, remote_max_age_s=so.load_lease_s))
        out.siblings = Siblings(
            worker.bus.endpoint(worker.index), kv, registry,
            share_speculation=not shared_index,
            speculative_ttl_s=settings.index.speculative_ttl_s, core=core,
            metrics=SiblingMetrics(prometheus),
        )  # fmt: skip
        kv.peers = out.siblings
        kv.tokens.share_prefixes(out.siblings.prefix_tokenized)
        if worker.publishes_fleet_load:
            own, sink = table.host_totals, table.set_remote
    elif shared_index and so.share_load:
        from gateway.fleet_load import PokingTracker, RemoteLoad

        tracker = PokingTracker(lambda: out.exchange.poke() if out.exchange else None)
        remote = RemoteLoad(max_age_s=so.load_lease_s)
        core.set_load(CombinedLoad(tracker, {"fleet": remote}))

        own, sink = tracker.keyed_counts, remote.update
    if shared_index and so.share_load and own is not None and sink is not None:
        from gateway.fleet_load import FleetLoadExchange, FleetLoadMetrics

        out.redis = _namespace_store(settings)
        replica = worker.host_id if worker is not None else secrets.token_hex(6)
        # A single process's requests read the others' counts when they need them
        # (``load_reader``), so between requests it only keeps its lease. A host's
        # worker 0 cannot tell when its siblings route: it keeps the interval.
        idle_s = so.load_interval_s if worker is not None else so.load_lease_s / 4
        out.exchange = FleetLoadExchange(
            out.redis, replica, own, sink,
            interval_s=so.load_interval_s, idle_interval_s=idle_s, lease_s=so.load_lease_s,
            max_replicas=so.max_replicas, metrics=FleetLoadMetrics(prometheus),
        )  # fmt: skip
    if shared_index and so.share_calibration:
        from gateway.fleet_calibration import CalibrationExchange

        out.redis = out.redis or _namespace_store(settings)
        out.calibration = CalibrationExchange(
            out.redis, lambda: kv_aware_calibrators(core), interval_s=so.calibration_interval_s
        )
    return out


def _namespace_store(settings: Settings) -> RedisStore:
    """A client of the index's Redis for the replicas' own data in its namespace."""
    from kvindex.redis_store import RedisStore

    idx = settings.index
    assert idx.redis_url is not None
    return RedisStore(idx.redis_url, namespace=idx.namespace, cluster=idx.redis_cluster)


def kv_aware_strategies(core: RoutingCore) -> list[KvAware]:
    """The core's kv-aware strategies as they are now (a reload may have replaced
    them)."""
    from routing.strategies.kv_aware import KvAware

    return [s for s in core.strategies() if isinstance(s, KvAware)]


def kv_aware_calibrators(core: RoutingCore) -> list[tuple[str, Calibrator]]:
    """Every model's calibrator of the core's kv-aware strategies."""
    return [pair for s in kv_aware_strategies(core) for pair in s.calibrators()]
