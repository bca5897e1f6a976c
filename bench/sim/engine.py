"""The simulated engine: scheduling, prefix cache, timing, KV events and metrics.

One request's life, as vLLM lives it:

1. wait in a FIFO queue for one of ``max_num_seqs`` running slots;
2. on scheduling, look up the prefix cache (hit capped so the last prompt token
   is recomputed), allocate and cache every full prompt block at once and
   publish one batch: ``BlockRemoved`` per evicted block, then one
   ``BlockStored`` for blocks ``[hit, full)``;
3. prefill: ``overhead_s + uncached_tokens / prefill_tokens_per_s``, through a
   prefill lane of ``prefill_concurrency`` (the GPU's compute is shared);
4. decode one token every ``itl_s``; each block that fills with computed tokens
   (prompt + output, less the last sampled token) is cached and published alone.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.sim.cache import LRUTier, TierChain, max_hit_blocks
from bench.sim.config import SimConfig
from bench.sim.events import AllBlocksCleared, AnyEvent, EventFactory, ZmqEventPublisher
from bench.sim.hashing import BlockHash, EngineHasher
from bench.sim.metrics import SimMetrics
from bench.sim.tokenizer import SimTokenizer


class FifoGate:
    """A counting gate whose waiters are served strictly first come, first served."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # release() hands its slot straight to us
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # we were handed a slot we will not use
            else:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1


@dataclass(slots=True)
class Admission:
    """What the scheduler decided for one request."""

    prompt_tokens: int
    cached_tokens: int
    created_cache_tokens: int  # vLLM's prompt_tokens_details.created_cache_tokens
    queue_s: float


@dataclass(slots=True)
class _Run:
    prompt: list[int]
    max_tokens: int
    cache_salt: str | None
    arrival: float
    tokens: list[int] = field(default_factory=list)  # prompt + output so far
    hashes: list[BlockHash] = field(default_factory=list)
    blocks_in_use: int = 0
    admission: Admission | None = None
    emitted: int = 0
    first_token_at: float = 0.0


@dataclass(slots=True)
class EngineStats:
    requests: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0


class SimEngine:
    """Shared state of one simulated pod; everything runs on the app's event loop."""

    def __init__(self, config: SimConfig, tokenizer: SimTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.hasher = EngineHasher(config.hash_seed, config.block_size)
        self.cache = TierChain([LRUTier(config.l0_capacity_blocks, "L0", "GPU")])
        self.stats = EngineStats()
        self._rng = random.Random(config.seed)
        self._slots = FifoGate(config.max_num_seqs)
        limit = config.prefill_concurrency
        self._prefill_lane = FifoGate(limit) if limit > 0 else None
        self._blocks_in_use = 0
        settings = config.kv_events
        self.publisher = (
            ZmqEventPublisher(settings, config.data_parallel_rank) if settings else None
        )
        self._events = EventFactory(config.block_size, bool(settings and settings.bytes_hashes))
        self.metrics = SimMetrics(
            config.model,
            config.engine_index,
            config.block_size,
            config.l0_capacity_blocks,
            running=lambda: self._slots.active,
            waiting=lambda: self._slots.waiting,
            kv_usage=self.kv_usage,
        )

    def kv_usage(self) -> float:
        """Fraction of blocks held by running requests (cached-but-free blocks count free)."""
        return min(self._blocks_in_use / self.config.l0_capacity_blocks, 1.0)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    @asynccontextmanager
    async def session(
        self, prompt: list[int], max_tokens: int, cache_salt: str | None = None
    ) -> AsyncIterator[_Run]:
        """Hold a running slot for one request; always releases and records it."""
        run = _Run(prompt, max_tokens, cache_salt, time.monotonic(), tokens=list(prompt))
        await self._slots.acquire()
        reason = "abort"
        try:
            run.admission = self._schedule(run)
            yield run
            reason = "length" if run.emitted >= run.max_tokens else "abort"
        finally:
            self._slots.release()
            self._blocks_in_use -= run.blocks_in_use
            self._finish(run, reason)

    def _schedule(self, run: _Run) -> Admission:
        cfg = self.config
        bs = cfg.block_size
        n = len(run.prompt)
        run.hashes = self.hasher.block_hashes(run.prompt, run.cache_salt)
        limit = max_hit_blocks(n, bs)
        hit = self.cache.lookup(run.hashes, max_blocks=limit).total
        result = self.cache.insert(run.hashes)
        events: list[AnyEvent] = [self._events.removed(h) for h in result.evicted]
        if result.held > hit:
            events.append(self._stored(run, hit, result.held))
        self._publish(events)
        run.blocks_in_use = -(-n // bs)
        self._blocks_in_use += run.blocks_in_use
        cached = hit * bs
        self._record_admission(n, cached, len(run.hashes), hit)
        return Admission(
            prompt_tokens=n,
            cached_tokens=cached,
            created_cache_tokens=max(0, min(result.held * bs, n) - cached),
            queue_s=time.monotonic() - run.arrival,
        )

    def _stored(self, run: _Run, start: int, end: int) -> AnyEvent:
        bs = self.config.block_size
        keys: list[tuple[Any, ...] | None] = []
        for i in range(start, end):
            extra = self.hasher.extra_keys(i, run.cache_salt)
            # Events carry the untagged values: ("cache_salt", s) -> s.
            keys.append(None if extra is None else tuple(k[1] for k in extra))
        parent = run.hashes[start - 1] if start > 0 else None
        return self._events.stored(
            run.hashes[start:end], parent, run.tokens[start * bs : end * bs], keys
        )

    def _publish(self, events: list[AnyEvent]) -> None:
        if self.publisher is not None and events:
            self.publisher.publish(events)

    def _record_admission(self, prompt: int, cached: int, blocks: int, hit: int) -> None:
        m, s = self.metrics, self.stats
        s.requests += 1
        s.queried_blocks += blocks
        s.hit_blocks += hit
        s.prompt_tokens += prompt
        s.cached_tokens += cached
        m.prefix_cache_queries.inc(prompt)
        m.prefix_cache_hits.inc(cached)
        m.prompt_tokens.inc(prompt)
        m.prompt_tokens_cached.inc(cached)

    async def prefill(self, run: _Run) -> Admission:
        """Sleep the prefill time; returns once the first token is ready."""
        assert run.admission is not None
        cfg = self.config
        uncached = run.admission.prompt_tokens - run.admission.cached_tokens
        lane = self._prefill_lane
        if lane is not None:
            await lane.acquire()
        try:
            await asyncio.sleep(cfg.overhead_s + uncached / cfg.prefill_tokens_per_s)
        finally:
            if lane is not None:
                lane.release()
        self.metrics.queue_time.observe(run.admission.queue_s)
        return run.admission

    async def tokens(self, run: _Run) -> AsyncIterator[int]:
        """Output token ids: the first at once (prefill made it), then one per ``itl_s``."""
        output = self.tokenizer.sample_output(self._rng, run.max_tokens)
        last = time.monotonic()
        for i, token in enumerate(output):
            if i:
                await asyncio.sleep(self.config.itl_s)
                now = time.monotonic()
                self.metrics.itl.observe(now - last)
                last = now
            else:
                run.first_token_at = last
                self.metrics.ttft.observe(last - run.arrival)
            run.tokens.append(token)
            run.emitted += 1
            self.metrics.generation_tokens.inc()
            self.stats.generated_tokens += 1
            self._cache_decoded(run)
            yield token

    def _cache_decoded(self, run: _Run) -> None:
        """Cache blocks filled by computed tokens (the newest sampled one is not computed)."""
        bs = self.config.block_size
        allocated = -(-len(run.tokens) // bs)
        if allocated > run.blocks_in_use:
            self._blocks_in_use += allocated - run.blocks_in_use
            run.blocks_in_use = allocated
        computed = len(run.tokens) - 1
        if computed // bs <= len(run.hashes):
            return
        start = len(run.hashes)
        run.hashes += self.hasher.block_hashes(run.tokens[:computed], run.cache_salt, run.hashes)
        result = self.cache.insert(run.hashes)
        events: list[AnyEvent] = [self._events.removed(h) for h in result.evicted]
        if result.held > start:
            events.append(self._stored(run, start, result.held))
        self._publish(events)

    def _finish(self, run: _Run, reason: str) -> None:
        self.metrics.request_success[reason].inc()
        if run.admission is not None:
            self.metrics.e2e.observe(time.monotonic() - run.arrival)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block and publish ``AllBlocksCleared``; returns blocks dropped."""
        dropped = self.cache.clear()
        self._publish([AllBlocksCleared()])
        return dropped

    def state(self) -> dict[str, Any]:
        """Counters for tests and benchmarks (never prompt-derived values)."""
        s = self.stats
        return {
            "model": self.config.model,
            "block_size": self.config.block_size,
            "tiers": [
                {"name": t.name, "medium": t.medium, "blocks": len(t), "capacity": t.capacity}
                for t in self.cache.tiers
            ],
            "requests": s.requests,
            "queried_blocks": s.queried_blocks,
            "hit_blocks": s.hit_blocks,
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "generated_tokens": s.generated_tokens,
            "running": self._slots.active,
            "waiting": self._slots.waiting,
            "kv_cache_usage": self.kv_usage(),
            "events_published": self.publisher.published if self.publisher else 0,
        }
