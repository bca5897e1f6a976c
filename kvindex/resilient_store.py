"""Redis with a local safety net: the index never fails a request.

``ResilientStore`` applies every event to a ``MemoryStore`` (this replica's own
view, always current) and to the shared ``RedisStore``. Lookups go to Redis
while it is healthy. On the first Redis error (connection refused, timeout,
OOM …) the breaker opens: lookups are served from the local view with no
Redis call at all, so a dead Redis costs one short socket timeout, not one per
request. A background task pings Redis with exponential backoff; when it answers
the store catches Redis up and closes the breaker:

* same Redis process (``run_id`` unchanged; a network blip): replay the events
  buffered while down (a bounded buffer);
* restarted Redis (data lost), buffer overflow, or a write that failed while Redis
  was up (part of it may be missing): push a snapshot of the local view, then the
  events buffered during the push. The debt stays until a push completes: a push
  cut short (a timeout) is made again whole at the next attempt.

A restart can also go unnoticed by every call (redis-py retries a stale pooled
connection, the store reloads a lost script): while the breaker is closed, a
background task compares Redis's ``run_id`` every ``identity_check_s`` (1 s) and,
when it changed, opens the breaker so that the local view is pushed.

In a Redis Cluster a lookup never waits for the namespace's node to be found (that
asks the known nodes one after another): while it is unknown, lookups are answered
locally and the background finds it.

Nothing raises to the caller; every error is counted
(``kvgate_index_redis_errors_total``) and every lookup answered locally
(``kvgate_index_fallbacks_total``). A lookup falls back on any exception, not only
a Redis error: one value no ``APPLY`` wrote must not fail every request whose
prefix reaches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Coroutine, Sequence
from enum import Enum
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.exceptions import RedisError

from kvindex.memory_store import MemoryStore
from kvindex.redis_store import RedisStore
from kvindex.store import IndexOp, IndexStats
from kvindex.types import Bound, PrefixMatch

log = logging.getLogger(__name__)
_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
BATCH_BYTES = 2_000  # a buffered batch of ~16 keys with positions (tracemalloc, typical)
IDENTITY_CHECK_S = 1.0  # how soon a Redis restart that no call noticed is resynced


class ResilientMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.redis_errors = Counter(
            "kvgate_index_redis_errors", "Redis index calls that failed", registry=registry
        )
        self.fallbacks = Counter(
            "kvgate_index_fallbacks", "Lookups served by the local index view", registry=registry
        )
        self.redis_up = Gauge(
            "kvgate_index_redis_up",
            "1 while lookups are served by Redis",
            registry=registry,
            multiprocess_mode="livemin",  # --workers: 0 if any worker is on its local view
        )
        self.redis_up.set(1)


class _State(Enum):
    UP = "up"
    DOWN = "down"
    CATCHING_UP = "catching_up"


class ResilientStore:
    """``IndexStore`` over a ``RedisStore`` with a ``MemoryStore`` fallback."""

    backend = "redis+memory"

    def __init__(
        self,
        primary: RedisStore,
        local: MemoryStore,
        metrics: ResilientMetrics,
        *,
        backoff_s: tuple[float, float] = (0.05, 5.0),
        max_buffered_batches: int = 10_000,
        identity_check_s: float = IDENTITY_CHECK_S,
    ) -> None:
        self.primary = primary
        self.local = local
        self.metrics = metrics
        self._backoff = backoff_s
        self._state = _State.UP
        # (pod, ops) event batches, or (pod, None) for drop_pod, while Redis is down
        self._buffer: deque[tuple[str, Sequence[IndexOp] | None]] = deque()
        self._max_buffered = max_buffered_batches
        # Redis may lack what the local view has (the buffer overflowed, a write failed
        # while Redis was up): the next catch-up pushes a snapshot
        self._resync_fully = False
        self._run_id: str | None = None
        self._probe: asyncio.Task[None] | None = None  # recovery, while the breaker is open
        self._identity_check_s = identity_check_s
        self._watcher: asyncio.Task[None] | None = None  # identity checks, while closed

    @property
    def using_redis(self) -> bool:
        return self._state is _State.UP

    async def apply(self, pod: str, ops: Sequence[IndexOp]) -> None:
        self.local.apply_now(pod, ops)
        self._watch_identity()
        if self._state is not _State.UP:
            self._buffer_ops(pod, ops)
            return
        try:
            if self._run_id is None:
                self._run_id = await self.primary.server_id()
            await self.primary.apply(pod, ops)
        except _ERRORS as exc:
            self._failed(exc)
            self._resync_fully = True  # part of this batch may be missing

    async def match(self, keys: Sequence[int], block_size: int) -> PrefixMatch:
        self._watch_identity()
        if self._lookups_use_redis():
            try:
                return await self.primary.match(keys, block_size)
            except Exception as exc:  # noqa: BLE001  (a lookup never fails: see the docstring)
                self._failed(exc)
        self.metrics.fallbacks.inc()
        return self.local.match_now(keys, block_size)

    async def speculate(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        """Speculation is short-lived: while Redis is down it only goes to the local view."""
        self.local.speculate_now(pod, keys, ttl_s)
        if self._state is _State.UP:
            try:
                await self.primary.speculate(pod, keys, ttl_s)
            except _ERRORS as exc:
                self._failed(exc)

    def speculate_nowait(
        self, pod: str, keys: Sequence[int], ttl_s: float
    ) -> Coroutine[Any, Any, None] | None:
        """The local view at once; Redis (while up) in the returned coroutine."""
        self.local.speculate_now(pod, keys, ttl_s)
        if self._state is not _State.UP:
            return None
        return self._speculate_shared(pod, keys, ttl_s)

    async def _speculate_shared(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        try:
            await self.primary.speculate(pod, keys, ttl_s)
        except _ERRORS as exc:
            self._failed(exc)

    async def l2_writers(self, keys: Sequence[int]) -> dict[str, int]:
        self._watch_identity()
        if self._lookups_use_redis():
            try:
                return await self.primary.l2_writers(keys)
            except Exception as exc:  # noqa: BLE001  (a lookup never fails)
                self._failed(exc)
        return self.local.l2_writers_now(keys)

    async def drop_pod(self, pod: str) -> None:
        self.local.drop_pod_now(pod)
        if self._state is _State.UP:
            try:
                await self.primary.drop_pod(pod)
                return
            except _ERRORS as exc:
                self._failed(exc)
        self._buffer_ops(pod, None)

    def l0_blocks_now(self, pod: str) -> int | None:
        """From the local view: it takes every event of the pods this process follows."""
        return self.local.l0_blocks_now(pod)

    async def stats(self) -> IndexStats:
        if self._state is _State.UP:
            try:
                return await self.primary.stats()
            except Exception as exc:  # noqa: BLE001  (a read never fails)
                self._failed(exc)
        return self.local.stats_now()

    def bounds(self) -> dict[str, Bound]:
        buffered = Bound(len(self._buffer), self._max_buffered, "batches", BATCH_BYTES)
        return {**self.local.bounds(), "index.redis_outage_buffer": buffered}

    async def close(self) -> None:
        for task in (self._probe, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.primary.close()
        await self.local.close()

    # -- breaker ----------------------------------------------------------------

    def _buffer_ops(self, pod: str, ops: Sequence[IndexOp] | None) -> None:
        if len(self._buffer) >= self._max_buffered:
            self._buffer.clear()
            self._resync_fully = True
        self._buffer.append((pod, ops))

    def _lookups_use_redis(self) -> bool:
        """Redis answers lookups while the breaker is closed and the namespace's node is
        known. Finding that node (a cluster, at start or after it may have moved) asks
        known nodes one after another, a socket timeout each that hangs: the recovery
        task does it in the background, never a request."""
        if self._state is not _State.UP:
            return False
        if self.primary.routed:
            return True
        log.info("redis index: locating the namespace's cluster node, serving the local view")
        self._open_breaker()
        return False

    def _failed(self, exc: BaseException) -> None:
        self.metrics.redis_errors.inc()
        if self._state is _State.UP:
            unexpected = not isinstance(exc, _ERRORS)  # a bug, or a value nobody expected
            log.warning(
                "redis index unavailable, serving the local view: %r", exc, exc_info=unexpected
            )
        self._open_breaker()

    def _open_breaker(self) -> None:
        """Serve the local view until the recovery task has caught Redis up."""
        self._state = _State.DOWN
        self.metrics.redis_up.set(0)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        delay = self._backoff[0]
        while True:
            await asyncio.sleep(delay)
            try:
                await self._catch_up()
                break
            except Exception as exc:  # noqa: BLE001  (any failure: try again later, never give up)
                self.metrics.redis_errors.inc()
                self._state = _State.DOWN
                unexpected = not isinstance(exc, _ERRORS)
                log.log(
                    logging.WARNING if unexpected else logging.DEBUG,
                    "redis index still unavailable: %r", exc, exc_info=unexpected,
                )  # fmt: skip
                delay = min(delay * 2, self._backoff[1])
        self._state = _State.UP
        self.metrics.redis_up.set(1)
        log.warning("redis index recovered")

    async def _catch_up(self) -> None:
        """Bring Redis up to date with the local view, then let lookups use it.

        A snapshot only adds entries: after an overflow on a Redis that kept its
        data, entries removed meanwhile linger until their TTL."""
        run_id = await self.primary.server_id()
        self._state = _State.CATCHING_UP
        if run_id != self._run_id:
            self._resync_fully = True  # a restarted Redis, or another one: it lost our data
        # an overflow while pushing or replaying sets the flag again: go round again
        while self._resync_fully or self._buffer:
            if self._resync_fully:
                await self._push_snapshot()
            await self._replay_buffer()
        self._run_id = run_id

    async def _push_snapshot(self) -> None:
        """Push the whole local view. The resync stays owed until all of it is in Redis:
        a push cut short (a timeout) must be made again, not skipped at the next try."""
        self._buffer.clear()  # the snapshot already contains these
        self._resync_fully = False  # set again by an overflow while pushing
        try:
            for pod, ops in self.local.snapshot():
                await self.primary.apply(pod, ops)
        except BaseException:
            self._resync_fully = True
            raise

    async def _replay_buffer(self) -> None:
        """Replay the events buffered while Redis was not in use, oldest first; an event
        is dropped only once it reached Redis (replaying one again is harmless)."""
        while self._buffer:
            pod, maybe_ops = self._buffer[0]
            if maybe_ops is None:
                await self.primary.drop_pod(pod)
            else:
                await self.primary.apply(pod, maybe_ops)
            self._buffer.popleft()

    # -- identity ---------------------------------------------------------------

    def _watch_identity(self) -> None:
        """Start the identity checks with the first call (the store is built before the
        event loop runs)."""
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._check_identity_forever())

    async def _check_identity_forever(self) -> None:
        """While the breaker is closed, ask Redis who it is every ``identity_check_s``
        (one ``INFO server``): a restart that lost the data and that no call noticed
        would otherwise leave the shared index without what was cached before it."""
        while True:
            await asyncio.sleep(self._identity_check_s)
            if self._state is _State.UP:
                await self._check_identity()

    async def _check_identity(self) -> None:
        try:
            run_id = await self.primary.server_id()
        except Exception as exc:  # noqa: BLE001  (counted and handled like any Redis failure)
            if self._state is _State.UP:
                self._failed(exc)
            return
        if self._state is not _State.UP:
            return  # the breaker opened meanwhile: catching up compares identities itself
        if self._run_id is None:
            self._run_id = run_id
        elif run_id != self._run_id:
            log.warning("redis index restarted (new run_id): pushing the local view to it")
            self._open_breaker()  # catching up sees the new run_id and pushes a snapshot
