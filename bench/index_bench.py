"""``kvgate bench index``: event ingestion and lookup latency, MemoryStore and Redis.

Two ingestion numbers per backend: ``store.apply`` of router-key ops alone, and the
whole event path (msgpack frames in vLLM's wire format → decode → engine-hash
translation → apply). Lookup latency is measured on prompts of 2k, 8k and 32k
tokens that are fully cached, the worst case for a prefix walk. Last, the memory a
``MemoryStore`` key costs (tracemalloc), what ``KEY_BYTES`` and ``/admin/bounds``
report, and a full index under new prompts: what a lookup and speculation cost while
each evicts as many keys, and what a full garbage collection then walks; the same for
a pod's full engine-hash map.
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TypeVar

import uvloop
from rich.console import Console
from rich.table import Table

from bench.event_ingest import (
    measure_ingestion,
    measure_live_batches,
    measure_warm_start,
)
from bench.index_lookup import print_index_bench, run_index_bench
from bench.redis_server import REDIS_SERVER, running_redis
from kvindex.events.engine_map import DEFAULT_CAPACITY, EngineKeyMap
from kvindex.memory_store import MemoryStore
from kvindex.redis_store import RedisStore
from kvindex.store import IndexStore, Stored
from kvindex.types import Tier

T = TypeVar("T")


def run_index_benchmarks(
    redis_url: str | None,
    start_redis: bool,
    lookups: int,
    ingest_blocks: int,
    block_size: int,
    console: Console,
) -> None:
    with ExitStack() as stack:
        if redis_url is None and start_redis:
            if REDIS_SERVER is None:
                console.print("[yellow]redis-server not on PATH: Redis rows skipped")
            else:
                redis_url = stack.enter_context(running_redis()).url
        factories: dict[str, object] = {"memory": lambda: MemoryStore(capacity_keys=4_000_000)}
        if redis_url:
            factories["redis"] = lambda: RedisStore(
                redis_url, namespace=f"bench-{uuid.uuid4().hex[:8]}", key_ttl_s=600
            )
        rows = []
        event_rates: dict[str, float] = {}
        for name, factory in factories.items():
            rows += asyncio.run(
                run_index_bench(
                    factory, block_size=block_size, n_lookups=lookups, n_ingest_blocks=ingest_blocks
                )
            )
            event_rates[name] = asyncio.run(
                _measured(factory(), lambda s: measure_ingestion(s, ingest_blocks, block_size))
            )
        print_index_bench(rows, console)
        table = Table(title="KV-event ingestion, vLLM wire frames → decode → translate → apply")
        table.add_column("backend")
        table.add_column("blocks/s", justify="right")
        for name, rate in event_rates.items():
            table.add_row(name, f"{rate:,.0f}")
        console.print(table)
    # Under uvloop, the gateway's loop: these two measure what events cost the loop.
    live_us = uvloop.run(_measured(MemoryStore(capacity_keys=1_000_000), measure_live_batches))
    console.print(
        f"Live KV events over ZMQ, one-block batches at 100/s into a MemoryStore: "
        f"{live_us:.0f} µs of the event loop's CPU a batch"
    )
    warm = uvloop.run(_measured(MemoryStore(capacity_keys=4_000_000), measure_warm_start))
    console.print(
        f"Warm start from a pod's full KV-event history ({warm.batches:,} batches of "
        f"~{warm.payload_bytes / 1024:.1f} KiB, sent back to back by a ROUTER in another "
        f"process, as vLLM's): warm in {warm.seconds:.2f} s, {warm.applied:,} batches "
        f"applied, {warm.replays} replay(s) asked ({warm.timeouts} ended on the idle "
        f"timeout); the event loop waited {warm.longest_stall_ms:.0f} ms at most"
    )
    per_key = memory_per_key()
    console.print(f"MemoryStore: {per_key:,.0f} bytes per key held by two pods (tracemalloc)")
    churn = full_index_churn()
    console.print(
        f"MemoryStore full ({churn.capacity:,} keys), a new {churn.blocks}-block prompt: "
        f"lookup + speculation p50 {churn.p50_us:.0f} / p99 {churn.p99_us:.0f} µs "
        f"(evicting as many keys); a full garbage collection then {churn.gc_ms:.1f} ms; "
        f"one of them speculated for the other pod without a lookup (a sibling worker's "
        f"speculation) p50 {churn.sibling_p50_us:.0f} µs"
    )
    hashes, gc_ms = full_engine_map_gc()
    console.print(
        f"Engine-hash map full ({hashes:,} hashes, one pod's): a full garbage collection "
        f"{gc_ms:.1f} ms"
    )


@dataclass(frozen=True, slots=True)
class Churn:
    capacity: int
    blocks: int
    p50_us: float
    p99_us: float
    gc_ms: float
    sibling_p50_us: float  # a present prompt speculated for another pod, no lookup first


def full_index_churn(capacity: int = 2_000_000, blocks: int = 100, prompts: int = 5_000) -> Churn:
    """A gateway's index at capacity under new prompts (each lookup misses, its
    speculation evicts the oldest keys), and what a full collection then walks: the
    store is made first and frozen, as the gateway's start-up freezes it
    (``gateway.heap.settle``), so the collection walks what the store grew since."""
    rng = random.Random(1)
    store = MemoryStore(capacity_keys=capacity)
    gc.collect()
    gc.freeze()
    try:
        for i in range(capacity // blocks + 1):
            store.speculate_now(f"pod-{i % 2}", _new_keys(rng, blocks), 5.0)
        samples = []
        last = prompts - min(prompts, 1_000)  # the prompts a sibling's speculation repeats
        replay = random.Random()
        for i in range(prompts):
            if i == last:
                replay.setstate(rng.getstate())
            keys = _new_keys(rng, blocks)
            started = time.perf_counter()
            store.match_now(keys, 16)
            store.speculate_now(f"pod-{i % 2}", keys, 5.0)
            samples.append(time.perf_counter() - started)
        started = time.perf_counter()
        gc.collect()
        gc_s = time.perf_counter() - started
        sibling = []
        for i in range(last, prompts):  # present, held by one pod: speculated for the other
            keys = _new_keys(replay, blocks)
            started = time.perf_counter()
            store.speculate_now(f"pod-{(i + 1) % 2}", keys, 5.0)
            sibling.append(time.perf_counter() - started)
    finally:
        gc.unfreeze()
    samples.sort()
    return Churn(capacity, blocks, 1e6 * samples[len(samples) // 2],
                 1e6 * samples[int(0.99 * (len(samples) - 1))], 1e3 * gc_s,
                 1e6 * sorted(sibling)[len(sibling) // 2])  # fmt: skip


def full_engine_map_gc(hashes: int = DEFAULT_CAPACITY) -> tuple[int, float]:
    """A pod's engine-hash map filled to its default capacity after start-up's freeze,
    as when a pod joins a running gateway: what a full collection then takes (ms)."""
    rng = random.Random(2)
    gc.collect()
    gc.freeze()
    try:
        engine_map = EngineKeyMap(hashes)
        for depth in range(hashes):
            key = rng.getrandbits(64) | 1 << 63
            engine_map.learn(rng.getrandbits(64), key, depth, key, key)
        gc.collect()  # what one look untracks (tuples of ints) is untracked from now on
        started = time.perf_counter()
        gc.collect()
        return len(engine_map), 1e3 * (time.perf_counter() - started)
    finally:
        gc.unfreeze()


def _new_keys(rng: random.Random, blocks: int) -> list[int]:
    return [rng.getrandbits(64) | 1 << 63 for _ in range(blocks)]


def memory_per_key(chains: int = 800, blocks: int = 128) -> float:
    """Bytes a ``MemoryStore`` holds per key (the key int included) for ``chains``
    prompts of ``blocks`` blocks, each stored in L0 by two pods as events do."""
    rng = random.Random(0)
    gc.collect()
    tracemalloc.start()
    try:
        store = MemoryStore(capacity_keys=chains * blocks)
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(chains):
            keys = [rng.getrandbits(64) | 1 << 63 for _ in range(blocks)]
            store.apply_now("pod-a", [Stored(Tier.L0, keys)])
            store.apply_now("pod-b", [Stored(Tier.L0, keys)])
        del keys
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / (chains * blocks)
    finally:
        tracemalloc.stop()


async def _measured(store: IndexStore, measure: Callable[[IndexStore], Awaitable[T]]) -> T:
    """``measure(store)``, the store closed afterwards whatever happened."""
    try:
        return await measure(store)
    finally:
        await store.close()
