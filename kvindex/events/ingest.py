"""Apply one pod's event batches to the index: decode → translate → ``store.apply``.

Shared by the ZMQ subscriber and the HTTP endpoint (``POST /admin/kv-events``) so a
pod's engine-hash map is the same whichever way its events arrive. One translator
(one engine map) per data-parallel rank: each rank is its own engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvindex.events.engine_map import DEFAULT_CAPACITY
from kvindex.events.translate import POD_TIERS, EventTranslator
from kvindex.events.types import EngineBatch
from kvindex.events.vllm_adapter import MalformedPayload, decode_payload
from kvindex.keyer import BlockKeyer
from kvindex.metrics import EventMetrics
from kvindex.store import Cleared, IndexOp, IndexStore
from kvindex.types import Bound

log = logging.getLogger(__name__)
MAX_RANKS = 64  # bounds the per-rank translators a stream can create


class PodIngestor:
    """Everything the index learns about one pod goes through here."""

    def __init__(
        self,
        pod: str,
        keyer: BlockKeyer,
        store: IndexStore,
        metrics: EventMetrics | None = None,
        map_capacity: int = DEFAULT_CAPACITY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pod = pod
        self.keyer = keyer
        self.store = store
        self.metrics = metrics if metrics is not None else EventMetrics()
        self.map_capacity = map_capacity
        self._clock = clock
        self._translators: dict[int, EventTranslator] = {}
        self._decode_errors = self.metrics.decode_errors.labels(pod=pod)
        self.store_errors = 0

    def translator(self, rank: int = 0) -> EventTranslator:
        tr = self._translators.get(rank)
        if tr is None:
            if len(self._translators) >= MAX_RANKS or rank < 0:
                raise ValueError(f"dp rank {rank} out of range")
            tr = EventTranslator(self.pod, self.keyer, self.metrics, self.map_capacity)
            self._translators[rank] = tr
        return tr

    def bounds(self) -> dict[str, Bound]:
        """The engine-hash map of each data-parallel rank seen so far."""
        return {f"engine_map[{self.pod}/{r}]": t.map.bound() for r, t in self._translators.items()}

    async def apply_payload(self, payload: bytes, rank: int = 0) -> bool:
        """Decode and apply one msgpack payload; False (counted) when malformed."""
        try:
            batch = decode_payload(payload)
        except MalformedPayload:
            self._decode_errors.inc()
            return False
        await self.apply_batch(batch, rank)
        return True

    async def apply_batch(self, batch: EngineBatch, rank: int = 0) -> int:
        """Translate and apply one decoded batch; returns the number of ops applied."""
        ops = self.translator(rank).translate(batch)
        if batch.ts > 0:
            self.metrics.event_lag.observe(max(0.0, self._clock() - batch.ts))
        if ops:
            await self._apply(ops)
        return len(ops)

    async def engine_restarted(self, rank: int = 0) -> None:
        """A rank's engine came back empty: drop the pod's L0/L1, forget its hashes."""
        self.metrics.engine_restarts.labels(pod=self.pod).inc()
        self.translator(rank).reset()
        await self._apply([Cleared(POD_TIERS)])

    async def _apply(self, ops: list[IndexOp]) -> None:
        try:
            await self.store.apply(self.pod, ops)
        except Exception:  # a store outage must not kill the event stream
            self.store_errors += 1
            if self.store_errors == 1 or self.store_errors % 1000 == 0:
                log.exception("pod %s: index store apply failed (%d)", self.pod, self.store_errors)
