"""The simulated engine: scheduling, tiered prefix cache, timing, KV events and metrics.

One request's life, as vLLM (with an offloading connector) lives it:

1. wait in a FIFO queue for one of ``max_num_seqs`` running slots;
2. on scheduling, look the prompt up in L0, then L1, then the shared L2 (hit capped
   so the last prompt token is recomputed; ``bench.podmodel.TieredCache``), promote
   the whole chain into L0 and publish one batch: ``BlockRemoved`` per evicted
   block, one ``BlockStored`` (GPU) for blocks ``[L0 hit, full)``, then the L1
   (``CPU``) stores and evictions, one hash per event like vLLM's connector;
3. load the L1/L2 hit (``latency + bytes / bandwidth`` per tier), then prefill
   ``overhead_s + uncached / prefill_tokens_per_s`` (or the measured
   ``prefill_curve``), plus ``prefill_s_per_running`` for each other request holding a
   slot, through a prefill lane of ``prefill_concurrency`` (the GPU's compute is
   shared; loads are not; ``PodTiming.lane_s`` has the rest);
4. write the prompt's full blocks through to L2 (``STORAGE``/``REMOTE`` events, or
   none in LMCache fs:// mode);
5. decode one token every ``itl_s + itl_per_seq_s x running``; each block that fills
   with computed tokens (prompt + output, less the last sampled token) is cached.

All timing and cache decisions come from ``bench.podmodel``, shared with the
discrete-event simulator.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.podmodel import Plan, TieredCache, TierHit
from bench.sim.cache import InsertResult
from bench.sim.config import SimConfig
from bench.sim.events import AllBlocksCleared, AnyEvent, EventFactory, ZmqEventPublisher
from bench.sim.hashing import BlockHash, EngineHasher
from bench.sim.l2dir import DirL2
from bench.sim.metrics import SimMetrics
from bench.sim.tokenizer import SimTokenizer
from kvindex.lru import BoundedLRU

_L2_NAME_MAP_CAPACITY = 262_144  # L2 file hash -> engine hash, for eviction events


class FifoGate:
    """A counting gate whose waiters are served strictly first come, first served."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> bool:
        """Take a slot; True if this had to wait for one (the gate was full)."""
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return False
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
        return True

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
    plan: Plan | None = None


@dataclass(slots=True)
class _Run:
    prompt: list[int]
    max_tokens: int
    cache_salt: str | None
    arrival: float
    lora: tuple[int, str] | None = None  # (lora_id, lora_name) of the adapter, if any
    tokens: list[int] = field(default_factory=list)  # prompt + output so far
    hashes: list[BlockHash] = field(default_factory=list)
    l2_keys: list[BlockHash] = field(default_factory=list)  # file names in the L2 dir
    blocks_in_use: int = 0
    admission: Admission | None = None
    emitted: int = 0
    first_token_at: float = 0.0

    @property
    def lora_name(self) -> str | None:
        return None if self.lora is None else self.lora[1]


@dataclass(slots=True)
class EngineStats:
    requests: int = 0
    queried_blocks: int = 0
    hit_blocks: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=lambda: {"L0": 0, "L1": 0, "L2": 0})
    l2_cross_pod_tokens: int = 0  # L2 tokens another pod wrote
    l2_blocks_written: int = 0


_NO_HIT = TierHit()


class SimEngine:
    """Shared state of one simulated pod; everything runs on the app's event loop."""

    def __init__(self, config: SimConfig, tokenizer: SimTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.timing = config.timing()
        self.name = config.pod_name or f"sim-{os.getpid()}"
        self.hasher = EngineHasher(config.hash_seed, config.block_size)
        self.l2 = DirL2(config.l2_dir, config.l2_capacity_blocks) if config.l2_dir else None
        # L2 files are named by hashes under the fleet's seed; when the engine's own
        # seed differs, a second chain is computed and mapped back for events.
        same_seed = config.l2_hash_seed == config.hash_seed
        self._l2_hasher = (
            None
            if same_seed or self.l2 is None
            else EngineHasher(config.l2_hash_seed, config.block_size)
        )
        self._l2_engine: BoundedLRU[BlockHash, BlockHash] = BoundedLRU(_L2_NAME_MAP_CAPACITY)
        self.cache = TieredCache(
            config.l0_capacity_blocks,
            config.l1_capacity_blocks,
            config.l1_policy,
            self.l2,
            self.name,
        )
        self.stats = EngineStats()
        self._rng = random.Random(config.seed)
        self._slots = FifoGate(config.max_num_seqs)
        limit = config.prefill_concurrency
        self._prefill_lane = FifoGate(limit) if limit > 0 else None
        # ``PodTiming.decode_waits_for_prefill``: prefills computing now, and a future
        # each prefill's end resolves (the step that gives every decoding request a token).
        self._prefilling = 0
        self._prefill_ended: asyncio.Future[None] | None = None
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
        self,
        prompt: list[int],
        max_tokens: int,
        cache_salt: str | None = None,
        lora: tuple[int, str] | None = None,
    ) -> AsyncIterator[_Run]:
        """Hold a running slot for one request; always releases and records it."""
        run = _Run(prompt, max_tokens, cache_salt, time.monotonic(), lora, tokens=list(prompt))
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
        run.hashes = self.hasher.block_hashes(run.prompt, run.cache_salt, lora_name=run.lora_name)
        run.l2_keys = self._l2_keys(run)
        hit = self.cache.lookup(run.hashes, n, bs, run.l2_keys)
        plan = self.timing.plan(n, hit, bs)
        done = self.cache.admit(run.hashes, hit, run.l2_keys)
        events: list[AnyEvent] = [self._events.removed(h) for h in done.l0.evicted]
        if done.l0.held > hit.l0:
            events.append(self._stored(run, hit.l0, done.l0.held))
        events += self._offload_events(done.l1, "CPU", None)
        self._publish(events)
        run.blocks_in_use = -(-n // bs)
        self._blocks_in_use += run.blocks_in_use
        self._record_admission(plan, len(run.hashes))
        if hit.l2 and self.l2 is not None:
            start = hit.l0 + hit.l1
            writers = self.l2.writers(run.l2_keys[start : start + hit.l2])
            self.stats.l2_cross_pod_tokens += bs * sum(1 for w in writers if w != self.name)
        return Admission(
            prompt_tokens=n,
            cached_tokens=plan.cached_tokens,
            created_cache_tokens=max(0, min(done.l0.held * bs, n) - plan.cached_tokens),
            queue_s=time.monotonic() - run.arrival,
            plan=plan,
        )

    def _l2_keys(self, run: _Run) -> list[BlockHash]:
        """The L2 file names of the prompt's blocks (the engine hashes if seeds agree)."""
        if self.l2 is None:
            return []
        if self._l2_hasher is None:
            return run.hashes
        keys = self._l2_hasher.block_hashes(run.prompt, run.cache_salt, lora_name=run.lora_name)
        for key, engine_hash in zip(keys, run.hashes, strict=True):
            self._l2_engine.put(key, engine_hash)
        return keys

    def _offload_events(
        self, result: InsertResult, medium: str, locality: str | None
    ) -> list[AnyEvent]:
        """One event per hash, stores then removals (disjoint sets, see ``LRUTier.put``)."""
        if locality is not None and self._l2_hasher is not None:
            get = self._l2_engine.get
            stored = [h for h in (get(k) for k in result.stored) if h is not None]
            evicted = [h for h in (get(k) for k in result.evicted) if h is not None]
        else:
            stored, evicted = result.stored, result.evicted
        f = self._events
        out: list[AnyEvent] = [f.offload_stored(h, medium, locality) for h in stored]  # type: ignore[arg-type]
        out += [f.offload_removed(h, medium, locality) for h in evicted]  # type: ignore[arg-type]
        return out

    def _stored(self, run: _Run, start: int, end: int) -> AnyEvent:
        bs = self.config.block_size
        keys: list[tuple[Any, ...] | None] = []
        for i in range(start, end):
            extra = self.hasher.extra_keys(i, run.cache_salt, run.lora_name)
            # Events carry the untagged values: ("cache_salt", s) -> s.
            keys.append(None if extra is None else tuple(k[1] for k in extra))
        parent = run.hashes[start - 1] if start > 0 else None
        return self._events.stored(
            run.hashes[start:end], parent, run.tokens[start * bs : end * bs], keys, lora=run.lora
        )

    def _publish(self, events: list[AnyEvent]) -> None:
        if self.publisher is not None and events:
            self.publisher.publish(events)

    def _record_admission(self, plan: Plan, blocks: int) -> None:
        m, s = self.metrics, self.stats
        local = plan.l0_tokens
        external = plan.external_tokens
        s.requests += 1
        s.queried_blocks += blocks
        s.hit_blocks += plan.cached_tokens // self.config.block_size
        s.prompt_tokens += plan.prompt_tokens
        s.cached_tokens += plan.cached_tokens
        s.tier_tokens["L0"] += local
        s.tier_tokens["L1"] += plan.l1_tokens
        s.tier_tokens["L2"] += plan.l2_tokens
        # vLLM 0.32: the local prefix cache counts every prompt token as queried and its
        # own hits; the connector is queried for what the local cache did not cover.
        m.prefix_cache_queries.inc(plan.prompt_tokens)
        m.prefix_cache_hits.inc(local)
        if self.cache.l1 is not None or self.l2 is not None:
            m.external_prefix_cache_queries.inc(plan.prompt_tokens - local)
            m.external_prefix_cache_hits.inc(external)
        m.prompt_tokens.inc(plan.prompt_tokens)
        m.prompt_tokens_cached.inc(plan.cached_tokens)
        m.by_source["local_compute"].inc(plan.uncached_tokens)
        m.by_source["local_cache_hit"].inc(local)
        m.by_source["external_kv_transfer"].inc(external)

    async def prefill(self, run: _Run) -> Admission:
        """Load the L1/L2 hit, then prefill through the lane; returns at the first token."""
        assert run.admission is not None and run.admission.plan is not None
        plan = run.admission.plan
        if plan.load_s > 0:
            await asyncio.sleep(plan.load_s)  # the connector loads outside the compute lane
        lane = self._prefill_lane
        queued = False
        if lane is not None:
            queued = await lane.acquire()
        try:
            others = self._slots.active - 1  # the requests holding a slot beside this one
            lane_s = self.timing.lane_s(plan.uncached_tokens, others, queued, self._rng,
                                        plan.cached_tokens)  # fmt: skip
            self._prefilling += 1
            try:
                await asyncio.sleep(lane_s)
            finally:
                self._prefilling -= 1
                ended, self._prefill_ended = self._prefill_ended, None
                if ended is not None and not ended.done():
                    ended.set_result(None)
        finally:
            if lane is not None:
                lane.release()
        self.metrics.queue_time.observe(run.admission.queue_s)
        self._write_l2(run)
        return run.admission

    def _write_l2(self, run: _Run) -> None:
        """Write the prompt's full blocks through to the shared directory."""
        if self.l2 is None:
            return
        result = self.cache.write_l2(run.l2_keys)
        self.stats.l2_blocks_written += len(result.stored)
        if self.config.l2_events == "storage":
            self._publish(self._offload_events(result, "STORAGE", "REMOTE"))

    async def tokens(self, run: _Run) -> AsyncIterator[int]:
        """Output token ids: the first at once (prefill made it), then one per ITL."""
        output = self.tokenizer.sample_output(self._rng, run.max_tokens)
        last = time.monotonic()
        for i, token in enumerate(output):
            if i:
                await self._next_step()
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

    async def _next_step(self) -> None:
        """Wait for the step that makes a decoding request's next token: one decode step,
        or, while a prefill computes on an engine whose steps carry it
        (``decode_waits_for_prefill``), that prefill's end."""
        if self._prefilling and self.timing.decode_waits_for_prefill:
            if self._prefill_ended is None:
                self._prefill_ended = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._prefill_ended)
        else:
            await asyncio.sleep(self.timing.itl_s(self._slots.active))

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
        run.hashes += self.hasher.block_hashes(
            run.tokens[:computed], run.cache_salt, run.hashes, run.lora_name
        )
        done = self.cache.admit(run.hashes, _NO_HIT)
        events: list[AnyEvent] = [self._events.removed(h) for h in done.l0.evicted]
        if done.l0.held > start:
            events.append(self._stored(run, start, done.l0.held))
        events += self._offload_events(done.l1, "CPU", None)
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

    def _tiers(self) -> list[dict[str, Any]]:
        c = self.cache
        tiers = [c.l0] + ([c.l1] if c.l1 is not None else [])
        out = [
            {"name": t.name, "medium": t.medium, "blocks": len(t), "capacity": t.capacity}
            for t in tiers
        ]
        if self.l2 is not None:
            out.append({"name": "L2", "medium": "STORAGE", "blocks": len(self.l2),
                        "capacity": self.l2.capacity})  # fmt: skip
        return out

    def state(self) -> dict[str, Any]:
        """Counters for tests and benchmarks (never prompt-derived values)."""
        s = self.stats
        return {
            "model": self.config.model,
            "block_size": self.config.block_size,
            "pod_name": self.name,
            "tiers": self._tiers(),
            "cached_tokens_by_tier": dict(s.tier_tokens),
            "l2_cross_pod_tokens": s.l2_cross_pod_tokens,
            "l2_blocks_written": s.l2_blocks_written,
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
