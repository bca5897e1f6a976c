"""InstrumentedStore: metrics live in the decorator, the answers stay the inner store's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvindex.instrumented import InstrumentedStore
from kvindex.memory_store import MemoryStore
from kvindex.store import Cleared, Removed, Stored
from kvindex.types import PodPrefix, Tier

K = [0xE000 + i for i in range(8)]


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


async def test_decorator_counts_ops_times_lookups_and_tracks_keys() -> None:
    registry = CollectorRegistry()
    store = InstrumentedStore(MemoryStore(100), registry, stats_interval_s=0)

    await store.apply(
        "a", [Stored(Tier.L0, K[:4]), Stored(Tier.L1, K[:5]), Removed(Tier.L0, K[3:4])]
    )
    await store.speculate("b", K[:2], ttl_s=60)
    m = await store.match(K, 16)
    await store.drop_pod("b")
    await store.apply("a", [Cleared()])

    assert m.pods == {"a": PodPrefix(3, 5), "b": PodPrefix(2, 2)}
    ops = {
        op: sample(registry, "kvgate_index_ops_total", op=op)
        for op in ("stored", "removed", "cleared", "match", "speculate", "drop_pod")
    }
    assert ops == {
        "stored": 2,
        "removed": 1,
        "cleared": 1,
        "match": 1,
        "speculate": 1,
        "drop_pod": 1,
    }
    assert sample(registry, "kvgate_index_lookup_seconds_count") == 1
    assert sample(registry, "kvgate_index_lookup_seconds_bucket", le="0.01") == 1
    assert sample(registry, "kvgate_index_keys") == 0  # refreshed after the final clear


async def test_keys_gauge_refreshes_at_most_once_per_interval() -> None:
    registry = CollectorRegistry()
    now = [0.0]
    store = InstrumentedStore(MemoryStore(100), registry, stats_interval_s=10, clock=lambda: now[0])

    await store.apply("a", [Stored(Tier.L0, K[:2])])
    await store.apply("a", [Stored(Tier.L0, K[2:5])])
    stale = sample(registry, "kvgate_index_keys")
    now[0] = 10.0
    await store.apply("a", [Stored(Tier.L0, K[5:6])])

    assert (stale, sample(registry, "kvgate_index_keys")) == (2, 6)
