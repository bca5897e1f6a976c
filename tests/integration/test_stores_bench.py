"""The index benchmark runs end to end on both backends and reports one row per size."""

from __future__ import annotations

import io
import uuid

import pytest
from rich.console import Console

from bench.event_ingest import measure_live_batches, measure_warm_start, pod_history
from bench.index_lookup import IndexBenchRow, print_index_bench, run_index_bench
from bench.redis_server import RedisServer
from kvindex.events.vllm_adapter import decode_payload
from kvindex.keyer import BlockKeyer
from kvindex.memory_store import MemoryStore
from kvindex.redis_store import RedisStore
from kvindex.store import IndexStore


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def factory(request: pytest.FixtureRequest):
    if request.param == "memory":
        return lambda: MemoryStore(capacity_keys=100_000)
    server: RedisServer = request.getfixturevalue("redis_server")
    ns = f"bench-{uuid.uuid4().hex[:8]}"

    async def make() -> IndexStore:  # async factories are accepted too
        return RedisStore(server.url, namespace=ns)

    return make


async def test_bench_reports_one_row_per_prompt_size(factory) -> None:
    rows = await run_index_bench(
        factory, prompt_tokens=(256, 1024), block_size=16, n_lookups=20, n_ingest_blocks=500
    )

    assert [(r.prompt_tokens, r.blocks, r.lookups) for r in rows] == [(256, 16, 20), (1024, 64, 20)]
    assert all(r.ingest_blocks_per_s > 0 for r in rows)
    assert all(0 < r.lookup_p50_us <= r.lookup_p99_us for r in rows)
    assert all(0 < r.partial_p50_us <= r.partial_p99_us for r in rows)
    assert all(0 < r.routed_p50_us <= r.routed_p99_us for r in rows)


def test_bench_table_prints_every_row() -> None:
    row = IndexBenchRow("memory", 32768, 2048, 400_000.0, 300, 512.4, 900.0, 600.0, 300.0, 700.0)
    out = io.StringIO()

    print_index_bench([row], Console(file=out, width=160))

    assert (
        "│ memory  │ 32,768 │  2,048 │         400k │    512 │    900 │     600 │            300 │"
        in out.getvalue()
    )


async def test_the_live_event_benchmark_applies_every_batch_it_times():
    """``kvgate bench index``'s live line: real ZMQ batches reach the store through the
    subscriber, every one of them, chained as the engine chained them."""
    store = MemoryStore(capacity_keys=100_000)
    us = await measure_live_batches(store, batches=40, rate=200.0, block_size=16)
    assert us > 0
    keys = BlockKeyer("bench-model", 16).keys(list(range(40 * 16)))
    assert store.match_now(keys, 16).for_pod("bench-pod").l0 == 40


async def test_the_warm_start_benchmark_replays_the_pods_whole_history_from_another_process():
    """``kvgate bench index``'s warm-start line: the history a vLLM-like ROUTER in
    another process sends back to back reaches the store whole before it is timed."""
    store = MemoryStore(capacity_keys=200_000)
    warm = await measure_warm_start(store, batches=200, block_size=32)
    assert (warm.batches, warm.applied) == (200, 200)
    assert warm.replays >= 1 and warm.seconds > 0 and warm.longest_stall_ms >= 0
    last_prompt = decode_payload(pod_history(200, 32)[-1]).events[0]
    keys = BlockKeyer("bench-model", 32).keys(last_prompt.token_ids)
    # its first block was evicted from GPU after its copy to CPU (the history's mix)
    assert store.match_now(keys, 32).for_pod("bench-pod").l0_l1 == len(keys) > 0
