"""Index micro-benchmark: event ingestion rate and lookup latency per prompt size.

``kvgate bench index`` (``bench/index_bench.py``) calls ``run_index_bench`` once per
backend and prints the rows with ``print_index_bench``.

What is measured, per prompt size (tokens / block_size = blocks per prompt):

* ingestion: ``Stored(L0)`` events for fresh prompts, shaped like vLLM's — one
  ``BlockStored`` per prefill chunk of ``op_blocks`` blocks, a batch per pod of
  up to ``batch_blocks`` blocks — applied back to back; reported in blocks/s;
* lookup: ``match`` on prompts held by several pods in every tier (one pod in
  L0, one half in L0 and all in L1, one in L1, the whole prompt in L2): the
  walk covers every key, the worst case for a lookup. p50/p99/mean in µs.
* lookup, then speculation ("+spec"): what the router does per request, a ``match``
  and at once ``speculate_nowait`` of the same keys on a pod that holds them, p50
  and p99 in µs of the two together (a shared store's write, which the router
  leaves to the background, is not timed);
* partial lookup: ``match`` on prompts of which only the first 3/4 (cut inside a
  16-block group) was ever stored, in L0 by one pod and in L2: the common case of
  a cached prefix followed by new tokens (``RedisStore`` reads that group's
  blocks in a second round trip). p50/p99 in µs.
"""

from __future__ import annotations

import gc
import inspect
import random
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

from rich.console import Console
from rich.table import Table

from kvindex.store import IndexStore, Stored, chain_positions
from kvindex.types import Tier

StoreFactory = Callable[[], IndexStore | Awaitable[IndexStore]]


@dataclass(frozen=True, slots=True)
class IndexBenchRow:
    backend: str
    prompt_tokens: int
    blocks: int  # keys per lookup
    ingest_blocks_per_s: float
    lookups: int
    lookup_p50_us: float
    lookup_p99_us: float
    lookup_mean_us: float
    partial_p50_us: float = 0.0
    partial_p99_us: float = 0.0
    routed_p50_us: float = 0.0  # lookup, then speculation of the same keys
    routed_p99_us: float = 0.0


def _prompt(rng: random.Random, blocks: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(blocks)]


def _batches(keys: list[int], op_blocks: int, batch_blocks: int) -> list[list[Stored]]:
    """Split one prompt's stored blocks into event batches of BlockStored-like ops
    (with chain positions, as the event translator emits them)."""
    pos = chain_positions(keys)
    ops = [
        Stored(Tier.L0, keys[i : i + op_blocks], pos.slice(i, i + op_blocks))
        for i in range(0, len(keys), op_blocks)
    ]
    per_batch = max(1, batch_blocks // op_blocks)
    return [ops[i : i + per_batch] for i in range(0, len(ops), per_batch)]


async def _ingest(
    store: IndexStore,
    rng: random.Random,
    blocks: int,
    total: int,
    pods: int,
    shape: tuple[int, int],
) -> float:
    """Blocks/s applying ``total`` blocks of fresh prompts (prompts built beforehand)."""
    work: list[tuple[str, list[Stored]]] = []
    n = 0
    while n < total:
        pod = f"pod-{len(work) % pods}"
        for batch in _batches(_prompt(rng, blocks), *shape):
            work.append((pod, batch))
        n += blocks
    gc.collect()
    start = time.perf_counter()
    for pod, batch in work:
        await store.apply(pod, batch)
    return n / (time.perf_counter() - start)


async def _populate(store: IndexStore, prompts: Sequence[list[int]]) -> None:
    for keys in prompts:
        pos = chain_positions(keys)
        n = len(keys) // 2
        half = Stored(Tier.L0, keys[:n], pos.slice(0, n))
        await store.apply("pod-0", [Stored(Tier.L0, keys, pos)])
        await store.apply("pod-1", [half, Stored(Tier.L1, keys, pos)])
        await store.apply("pod-2", [Stored(Tier.L1, keys, pos)])
        await store.apply("pod-3", [Stored(Tier.L2, keys, pos)])


async def _populate_partial(store: IndexStore, prompts: Sequence[list[int]]) -> int:
    """Store the first 3/4 of each prompt (cut 5 blocks into a group); returns the cut."""
    cut = min(len(prompts[0]) - 1, len(prompts[0]) * 3 // 4 + 5)
    for keys in prompts:
        pos = chain_positions(keys[:cut])
        await store.apply("pod-0", [Stored(Tier.L0, keys[:cut], pos)])
        await store.apply("pod-3", [Stored(Tier.L2, keys[:cut], pos)])
    return cut


async def _lookups(
    store: IndexStore,
    prompts: Sequence[list[int]],
    n: int,
    block_size: int,
    held: int,
    speculate_on: str | None = None,
) -> list[float]:
    """``n`` timed lookups (each followed by speculation on ``speculate_on``, timed
    with it, when given); each must find ``held`` blocks in L2."""
    for keys in prompts:  # warm up (script load, connection pool)
        await store.match(keys, block_size)
    gc.collect()
    samples = []
    for i in range(n):
        keys = prompts[i % len(prompts)]
        start = time.perf_counter()
        m = await store.match(keys, block_size)
        pending = None
        if speculate_on is not None:  # as the router does: what is not local waits
            pending = store.speculate_nowait(speculate_on, keys, 60.0)
        samples.append(time.perf_counter() - start)
        if pending is not None:
            await pending
        if m.l2 != held:
            raise RuntimeError(f"index lost blocks during the benchmark: l2={m.l2}")
    return samples


async def run_index_bench(
    store_factory: StoreFactory,
    prompt_tokens: Sequence[int] = (2048, 8192, 32768),
    block_size: int = 16,
    n_lookups: int = 300,
    n_ingest_blocks: int = 50_000,
    *,
    n_prompts: int = 8,
    pods: int = 8,
    op_blocks: int = 128,
    batch_blocks: int = 512,
    seed: int = 0,
) -> list[IndexBenchRow]:
    """One row per prompt size; the store comes from ``store_factory`` and is closed."""
    made = store_factory()
    store: IndexStore = await made if inspect.isawaitable(made) else made
    rng = random.Random(seed)
    rows = []
    try:
        for tokens in prompt_tokens:
            blocks = tokens // block_size
            rate = await _ingest(
                store, rng, blocks, n_ingest_blocks, pods, (op_blocks, batch_blocks)
            )
            prompts = [_prompt(rng, blocks) for _ in range(n_prompts)]
            await _populate(store, prompts)
            samples = await _lookups(store, prompts, n_lookups, block_size, blocks)
            routed = await _lookups(store, prompts, n_lookups, block_size, blocks, "pod-0")
            partial = [_prompt(rng, blocks) for _ in range(n_prompts)]
            cut = await _populate_partial(store, partial)
            partial_samples = await _lookups(store, partial, n_lookups, block_size, cut)
            backend = str(getattr(store, "backend", "?"))
            row = _row(backend, tokens, blocks, rate, samples, partial_samples)
            rows.append(replace(row, routed_p50_us=_p50(routed), routed_p99_us=_p99(routed) * 1e6))
    finally:
        await store.close()
    return rows


def _p50(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def _row(
    backend: str, tokens: int, blocks: int, rate: float, s: list[float], partial: list[float]
) -> IndexBenchRow:
    return IndexBenchRow(
        backend=backend,
        prompt_tokens=tokens,
        blocks=blocks,
        ingest_blocks_per_s=rate,
        lookups=len(s),
        lookup_p50_us=statistics.median(s) * 1e6,
        lookup_p99_us=_p99(s) * 1e6,
        lookup_mean_us=statistics.fmean(s) * 1e6,
        partial_p50_us=statistics.median(partial) * 1e6,
        partial_p99_us=_p99(partial) * 1e6,
    )


def print_index_bench(rows: Sequence[IndexBenchRow], console: Console | None = None) -> None:
    table = Table(title="kvgate index benchmark (lookup = full-prompt hit, worst case)")
    table.add_column("backend", no_wrap=True)
    columns = ("tokens", "blocks", "ingest blk/s", "p50 µs", "p99 µs", "mean µs")
    for col in (*columns, "partial p50 µs", "partial p99 µs", "+spec p50 µs", "+spec p99 µs"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            r.backend,
            f"{r.prompt_tokens:,}",
            f"{r.blocks:,}",
            f"{r.ingest_blocks_per_s / 1000:,.0f}k",
            f"{r.lookup_p50_us:,.0f}",
            f"{r.lookup_p99_us:,.0f}",
            f"{r.lookup_mean_us:,.0f}",
            f"{r.partial_p50_us:,.0f}",
            f"{r.partial_p99_us:,.0f}",
            f"{r.routed_p50_us:,.0f}",
            f"{r.routed_p99_us:,.0f}",
        )
    table.caption = f"{rows[0].lookups:,} lookups per row" if rows else None
    (console or Console()).print(table)
