"""IndexStore semantics, run against every backend and wrapper.

MemoryStore, RedisStore, ResilientStore (Redis with a local view) and
InstrumentedStore (metrics decorator) must give the same answers, the Redis ones on
one server and on a Redis Cluster.

RedisStore talks to a real redis-server (the ``redis_server`` fixture); each test gets
its own namespace, so tests never see each other's keys.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from kvindex.instrumented import InstrumentedStore
from kvindex.memory_store import MemoryStore
from kvindex.redis_store import RedisStore
from kvindex.resilient_store import ResilientMetrics, ResilientStore
from kvindex.store import Cleared, IndexStore, Removed, Stored
from kvindex.types import PodPrefix, Tier

K = [0xA000 + i for i in range(12)]  # a 12-block prompt's chained keys
L0, L1, L2 = Tier.L0, Tier.L1, Tier.L2
Store = MemoryStore | RedisStore | ResilientStore | InstrumentedStore


@pytest.fixture(
    params=[
        "memory",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("resilient", marks=pytest.mark.redis),  # Redis + local view
        pytest.param("redis-cluster", marks=pytest.mark.redis),  # 3 masters, a replica each
        pytest.param("resilient-cluster", marks=pytest.mark.redis),
        "instrumented",  # the metrics decorator around a MemoryStore
    ]
)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    s: Store
    if request.param == "memory":
        s = MemoryStore(capacity_keys=10_000)
    elif request.param == "instrumented":
        s = InstrumentedStore(MemoryStore(capacity_keys=10_000), CollectorRegistry())
    else:
        cluster = request.param.endswith("cluster")
        server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
        s = RedisStore(
            server.url, namespace=f"t-{uuid.uuid4().hex[:8]}", key_ttl_s=60, cluster=cluster
        )
        if request.param.startswith("resilient"):
            s = ResilientStore(s, MemoryStore(10_000), ResilientMetrics(CollectorRegistry()))
    yield s
    await s.close()


async def test_every_backend_satisfies_the_index_store_protocol(store: Store) -> None:
    assert isinstance(store, IndexStore)


async def test_match_reports_per_pod_l0_and_l0_l1_prefixes(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:4]), Stored(L1, K[:6])])
    await store.apply("b", [Stored(L1, K[:2])])

    m = await store.match(K[:8], block_size=16)

    assert m.pods == {"a": PodPrefix(l0=4, l0_l1=6), "b": PodPrefix(l0=0, l0_l1=2)}
    assert (m.total_blocks, m.block_size, m.l2) == (8, 16, 0)


async def test_l0_l1_prefix_counts_blocks_held_in_either_tier(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:2]), Stored(L1, K[2:4]), Stored(L0, K[4:5])])

    m = await store.match(K, 16)

    assert m.pods == {"a": PodPrefix(l0=2, l0_l1=5)}


async def test_prefix_counts_from_the_first_key_only(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[1:6]), Stored(L2, K[1:6])])

    m = await store.match(K, 16)

    assert (m.pods, m.l2) == ({}, 0)


async def test_l2_written_by_one_pod_is_available_fleet_wide(store: Store) -> None:
    await store.apply("a", [Stored(L2, K[:5])])
    await store.apply("b", [Stored(L0, K[:2])])

    m = await store.match(K, 16)

    assert m.l2 == 5
    assert m.pods == {"b": PodPrefix(l0=2, l0_l1=2)}  # a holds nothing locally


async def test_l2_removed_by_any_pod_is_gone_for_all(store: Store) -> None:
    await store.apply("a", [Stored(L2, K[:5])])
    await store.apply("b", [Removed(L2, K[2:3])])

    assert (await store.match(K, 16)).l2 == 2


async def test_lookup_stops_at_first_key_nobody_holds(store: Store) -> None:
    # K[2] is held by nobody; K[3:] would extend every chain if the walk went on
    await store.apply("a", [Stored(L0, K[:2] + K[3:8])])
    await store.apply("b", [Stored(L2, K[:2] + K[3:8])])

    m = await store.match(K, 16)

    assert (m.pods, m.l2) == ({"a": PodPrefix(l0=2, l0_l1=2)}, 2)


async def test_a_pod_chain_ends_where_that_pod_misses_a_block(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:2] + K[3:8])])
    await store.apply("b", [Stored(L0, K[:8])])

    m = await store.match(K, 16)

    assert m.pods == {"a": PodPrefix(l0=2, l0_l1=2), "b": PodPrefix(l0=8, l0_l1=8)}


async def test_removed_shortens_that_pods_prefix_in_that_tier(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:6]), Stored(L1, K[:6])])
    await store.apply("a", [Removed(L0, K[3:4]), Removed(L1, K[5:6])])

    assert (await store.match(K, 16)).pods == {"a": PodPrefix(l0=3, l0_l1=6)}


async def test_stored_is_idempotent_and_one_removal_undoes_it(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:3]), Stored(L0, K[:3])])
    await store.apply("a", [Removed(L0, K[:3])])

    assert (await store.match(K, 16)).pods == {}


async def test_removal_by_another_pod_leaves_local_tiers_alone(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:3])])
    await store.apply("b", [Removed(L0, K[:3]), Removed(L1, K[:3])])

    assert (await store.match(K, 16)).pods == {"a": PodPrefix(l0=3, l0_l1=3)}


async def test_cleared_drops_the_pods_entries_in_the_given_tiers_only(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:4]), Stored(L1, K[:6]), Stored(L2, K[:3])])
    await store.apply("b", [Stored(L0, K[:2])])

    await store.apply("a", [Cleared((L0,))])
    m = await store.match(K, 16)
    assert (m.pods, m.l2) == ({"a": PodPrefix(0, 6), "b": PodPrefix(2, 2)}, 3)

    await store.apply("a", [Cleared((L1, L2))])
    m = await store.match(K, 16)
    assert (m.pods, m.l2) == ({"b": PodPrefix(2, 2)}, 0)


async def test_cleared_applies_in_order_within_a_batch(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:4]), Cleared(), Stored(L0, K[:2])])

    assert (await store.match(K, 16)).pods == {"a": PodPrefix(2, 2)}


async def test_drop_pod_forgets_its_l0_l1_but_keeps_shared_l2(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:4]), Stored(L1, K[:6]), Stored(L2, K[:5])])
    await store.apply("b", [Stored(L1, K[:3])])

    await store.drop_pod("a")
    m = await store.match(K, 16)

    assert (m.pods, m.l2) == ({"b": PodPrefix(0, 3)}, 5)


async def test_speculative_entry_counts_as_l0_until_its_ttl(store: Store) -> None:
    await store.apply("a", [Stored(L1, K[:5])])
    await store.speculate("a", K[:3], ttl_s=0.3)
    await store.speculate("c", K[:4], ttl_s=0.3)

    m = await store.match(K, 16)
    assert m.pods == {"a": PodPrefix(3, 5), "c": PodPrefix(4, 4)}

    await asyncio.sleep(0.45)
    assert (await store.match(K, 16)).pods == {"a": PodPrefix(0, 5)}


async def test_confirmed_speculation_never_expires(store: Store) -> None:
    await store.speculate("c", K[:4], ttl_s=0.3)
    await store.apply("c", [Stored(L0, K[:2])])

    await asyncio.sleep(0.45)

    assert (await store.match(K, 16)).pods == {"c": PodPrefix(2, 2)}


async def test_removed_l0_also_cancels_speculation(store: Store) -> None:
    await store.speculate("c", K[:4], ttl_s=30)
    await store.apply("c", [Removed(L0, K[1:2])])

    assert (await store.match(K, 16)).pods == {"c": PodPrefix(1, 1)}


async def test_l2_writers_counts_blocks_per_writer_in_the_l2_prefix(store: Store) -> None:
    await store.apply("a", [Stored(L2, K[:3])])
    await store.apply("b", [Stored(L2, K[3:5]), Stored(L2, K[6:8])])

    assert await store.l2_writers(K) == {"a": 3, "b": 2}


async def test_empty_lookup_and_unknown_keys_match_nothing(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:3])])

    empty = await store.match([], 16)
    unknown = await store.match([0xDEAD, *K], 16)

    assert (empty.total_blocks, empty.pods, empty.l2) == (0, {}, 0)
    assert (unknown.total_blocks, unknown.pods, unknown.l2) == (13, {}, 0)


async def test_drop_of_unknown_pod_and_removal_of_unknown_keys_are_noops(store: Store) -> None:
    await store.apply("a", [Stored(L0, K[:3])])

    await store.drop_pod("nobody")
    await store.apply("a", [Removed(L0, [0xBEEF]), Removed(L2, [0xBEEF])])

    assert (await store.match(K, 16)).pods == {"a": PodPrefix(3, 3)}


async def test_large_keys_round_trip(store: Store) -> None:
    big = [2**64 - 1, 2**63, 0]

    await store.apply("a", [Stored(L0, big)])

    assert (await store.match(big, 16)).pods == {"a": PodPrefix(3, 3)}
