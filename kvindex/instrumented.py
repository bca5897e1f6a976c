"""Metrics for any ``IndexStore``, as a decorator (after llm-d's instrumented_index.go).

Backends stay free of metrics code; wrap whichever store the config builds:
``InstrumentedStore(ResilientStore(RedisStore(...), MemoryStore(...), ...), registry)``.

* ``kvgate_index_lookup_seconds`` — histogram of ``match`` latency, buckets 10 µs–10 ms
  (MemoryStore lookups sit at the low end, Redis round trips at the high end);
* ``kvgate_index_keys`` — distinct block keys held, refreshed from ``stats()`` at
  most every ``stats_interval_s`` after writes (a Redis ``stats`` is a round trip);
* ``kvgate_index_ops_total{op}`` — calls by kind: ``stored``, ``removed``,
  ``cleared`` (one per op in a batch), ``match``, ``speculate``, ``drop_pod``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvindex.store import Cleared, IndexOp, IndexStats, IndexStore, Removed, Stored
from kvindex.types import Bound, PrefixMatch

LOOKUP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2)
_OP_NAMES: dict[type, str] = {Stored: "stored", Removed: "removed", Cleared: "cleared"}


class StoreMetrics:
    """Lookup latency, key count and op counts of one store (``kvgate_index_*``); the
    event pipeline's counters are ``kvindex.metrics.EventMetrics``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookup_seconds = Histogram(
            "kvgate_index_lookup_seconds",
            "Latency of one index prefix lookup",
            buckets=LOOKUP_BUCKETS,
            registry=registry,
        )
        self.keys = Gauge(
            "kvgate_index_keys",
            "Distinct block keys held by the index",
            registry=registry,
            multiprocess_mode="livemax",  # --workers: every worker holds the same index
        )
        self.ops = Counter(
            "kvgate_index_ops", "Index operations by kind", ["op"], registry=registry
        )


class InstrumentedStore:
    """Wraps an ``IndexStore`` (plus ``speculate``/``l2_writers`` when it has them)."""

    def __init__(
        self,
        inner: IndexStore,
        registry: CollectorRegistry,
        *,
        stats_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self.metrics = StoreMetrics(registry)
        self._interval = stats_interval_s
        self._clock = clock
        self._last_refresh = float("-inf")
        self._op_children = {
            name: self.metrics.ops.labels(op=name)
            for name in ("stored", "removed", "cleared", "match", "speculate", "drop_pod")
        }

    @property
    def backend(self) -> str:
        return str(getattr(self.inner, "backend", type(self.inner).__name__))

    async def apply(self, pod: str, ops: Sequence[IndexOp]) -> None:
        await self.inner.apply(pod, ops)
        for op in ops:
            name = _OP_NAMES.get(type(op))
            if name is not None:
                self._op_children[name].inc()
        await self._maybe_refresh()

    async def match(self, keys: Sequence[int], block_size: int) -> PrefixMatch:
        start = time.perf_counter()
        try:
            return await self.inner.match(keys, block_size)
        finally:
            self.metrics.lookup_seconds.observe(time.perf_counter() - start)
            self._op_children["match"].inc()

    async def speculate(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        inner: Any = self.inner
        await inner.speculate(pod, keys, ttl_s)
        self._op_children["speculate"].inc()

    def speculate_nowait(
        self, pod: str, keys: Sequence[int], ttl_s: float
    ) -> Coroutine[Any, Any, None] | None:
        inner: Any = self.inner
        pending = inner.speculate_nowait(pod, keys, ttl_s)
        self._op_children["speculate"].inc()
        return pending

    async def l2_writers(self, keys: Sequence[int]) -> dict[str, int]:
        inner: Any = self.inner
        return dict(await inner.l2_writers(keys))

    async def drop_pod(self, pod: str) -> None:
        await self.inner.drop_pod(pod)
        self._op_children["drop_pod"].inc()
        await self._maybe_refresh()

    def l0_blocks_now(self, pod: str) -> int | None:
        inner: Any = self.inner
        held: int | None = inner.l0_blocks_now(pod)
        return held

    async def stats(self) -> IndexStats:
        stats = await self.inner.stats()
        self.metrics.keys.set(stats.keys)
        self._last_refresh = self._clock()
        return stats

    def bounds(self) -> dict[str, Bound]:
        inner: Any = self.inner
        return dict(inner.bounds()) if hasattr(inner, "bounds") else {}

    async def close(self) -> None:
        await self.inner.close()

    async def _maybe_refresh(self) -> None:
        if self._clock() - self._last_refresh >= self._interval:
            await self.stats()
