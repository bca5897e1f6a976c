"""The index on a real Redis Cluster whose master dies: a replica is promoted and no
lookup goes wrong meanwhile (the local view answers), then Redis is used again.

The store's whole suite also runs on a cluster (``redis_target``/``redis_cluster`` in
``tests/conftest.py``); here is what only a cluster has: a namespace's slot moving to
another node.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from bench.polling import wait_for_async
from bench.redis_server import RedisClusterServers
from kvindex.memory_store import MemoryStore
from kvindex.redis_store import RedisStore
from kvindex.resilient_store import ResilientMetrics, ResilientStore
from kvindex.store import Stored, chain_positions
from kvindex.types import PodPrefix, Tier

pytestmark = pytest.mark.redis
K = [0xD000 + i for i in range(64)]
NS = "failover"


def resilient(cluster: RedisClusterServers, registry: CollectorRegistry) -> ResilientStore:
    primary = RedisStore(cluster.url, namespace=NS, cluster=True, socket_timeout=0.2)
    return ResilientStore(primary, MemoryStore(10_000), ResilientMetrics(registry),
                          backoff_s=(0.05, 0.5))  # fmt: skip


async def test_the_store_finds_its_slots_master_from_any_node(
    redis_cluster: RedisClusterServers,
) -> None:
    writer = RedisStore(redis_cluster.url, namespace=NS + "-find", cluster=True)
    seed = next(p for p in redis_cluster.ports if p != redis_cluster.master_of(writer.slot))
    reader = RedisStore(f"redis://127.0.0.1:{seed}/0", namespace=NS + "-find", cluster=True)
    try:
        await writer.apply("a", [Stored(Tier.L0, K[:5])])

        assert (await reader.match(K, 16)).pods == {"a": PodPrefix(5, 5)}
        assert reader.client.connection_pool.connection_kwargs["port"] == (
            redis_cluster.master_of(reader.slot)
        )
        assert (await reader.stats()).keys >= 5  # the slot's keys, not the node's
    finally:
        await writer.close()
        await reader.close()


async def test_a_killed_master_loses_no_routing_and_the_promoted_replica_is_caught_up(
    private_redis_cluster: RedisClusterServers,
) -> None:
    cluster = private_redis_cluster
    registry = CollectorRegistry()
    store = resilient(cluster, registry)
    other_replica = RedisStore(cluster.url, namespace=NS, cluster=True)  # another gateway
    try:
        pos = chain_positions(K)
        await store.apply("a", [Stored(Tier.L0, K[:32], pos.slice(0, 32))])
        await store.apply("b", [Stored(Tier.L1, K, pos)])
        assert store.using_redis
        expected = {"a": PodPrefix(32, 32), "b": PodPrefix(0, 64)}
        assert (await other_replica.match(K, 16)).pods == expected

        master = cluster.master_of(store.primary.slot)
        cluster.kill(master)
        started = time.monotonic()
        answers = []
        # Routing goes on through the failover: every lookup right, events still taken.
        while store.using_redis or time.monotonic() - started < 1.0:
            answers.append((await store.match(K, 16)).pods)
            await asyncio.sleep(0.02)
        await store.apply("c", [Stored(Tier.L0, K[:8], pos.slice(0, 8))])  # while down
        expected["c"] = PodPrefix(8, 8)
        new_master = cluster.wait_failover(store.primary.slot, master)

        while not store.using_redis:
            answers.append((await store.match(K, 16)).pods)
            await asyncio.sleep(0.05)
            assert time.monotonic() - started < 30, "the store never used Redis again"

        assert all(a in ({k: v for k, v in expected.items() if k != "c"}, expected)
                   for a in answers)  # fmt: skip
        assert registry.get_sample_value("kvgate_index_fallbacks_total") >= 1
        assert new_master != master
        assert store.primary.client.connection_pool.connection_kwargs["port"] == new_master
        # Redis has everything again, the outage's events too: the other replica reads it.
        assert (await store.match(K, 16)).pods == expected
        fallbacks = registry.get_sample_value("kvgate_index_fallbacks_total")
        for _ in range(40):  # its client reconnects to the new master by itself
            try:
                if (await other_replica.match(K, 16)).pods == expected:
                    break
            except Exception:  # noqa: BLE001  (its first calls hit the dead master)
                await asyncio.sleep(0.1)
        assert (await other_replica.match(K, 16)).pods == expected
        assert registry.get_sample_value("kvgate_index_fallbacks_total") == fallbacks
    finally:
        await store.close()
        await other_replica.close()


async def test_a_lookup_never_waits_for_the_slots_master_to_be_found(
    redis_cluster: RedisClusterServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    primary = RedisStore(redis_cluster.url, namespace=NS + "-locate", cluster=True,
                         socket_timeout=0.2)  # fmt: skip
    store = ResilientStore(primary, MemoryStore(10_000), ResilientMetrics(CollectorRegistry()),
                           backoff_s=(0.05, 0.5))  # fmt: skip
    try:
        await store.apply("a", [Stored(Tier.L0, K[:8])])
        assert store.using_redis and primary.routed

        async def lost_connection(_client: Redis) -> None:
            raise RedisConnectionError("injected")

        # another user of the namespace's node (the fleet's load) saw it fail: the next
        # call must look the slot's master up again
        with pytest.raises(RedisConnectionError):
            await primary.on_namespace(lost_connection)
        assert not primary.routed
        locate = primary._master.locate

        async def slow_locate(current: Redis) -> Redis:  # the first nodes asked hang
            await asyncio.sleep(1.0)
            return await locate(current)

        monkeypatch.setattr(primary._master, "locate", slow_locate)

        started = time.perf_counter()
        answer = await store.match(K, 16)
        elapsed = time.perf_counter() - started

        assert answer.pods == {"a": PodPrefix(8, 8)}  # the local view's
        assert elapsed < 0.5
        await wait_for_async(lambda: store.using_redis, timeout=10.0, what="Redis in use again")
        assert primary.routed
        assert (await store.match(K, 16)).pods == {"a": PodPrefix(8, 8)}
    finally:
        await store.close()
