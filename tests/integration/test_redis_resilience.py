"""ResilientStore against a redis-server that crashes, hangs and comes back."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Sequence

import pytest
from prometheus_client import CollectorRegistry
from redis.exceptions import TimeoutError as RedisTimeoutError

from bench.polling import wait_for_async
from bench.ports import free_port
from bench.redis_server import RedisServer
from kvindex.memory_store import MemoryStore
from kvindex.redis_store import RedisStore
from kvindex.resilient_store import ResilientMetrics, ResilientStore
from kvindex.store import Cleared, IndexOp, Removed, Stored
from kvindex.types import PodPrefix, PrefixMatch, Tier

pytestmark = pytest.mark.redis
K = [0xC000 + i for i in range(16)]
NS = "resilience"


@pytest.fixture
def server(private_redis: RedisServer) -> RedisServer:
    """These tests kill, pause and restart their redis-server."""
    return private_redis


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def store(server: RedisServer, registry: CollectorRegistry) -> AsyncIterator[ResilientStore]:
    primary = RedisStore(server.url, namespace=NS, socket_timeout=0.1)
    s = ResilientStore(
        primary, MemoryStore(1000), ResilientMetrics(registry), backoff_s=(0.02, 0.1)
    )
    yield s
    await s.close()


def counter(registry: CollectorRegistry, name: str) -> float:
    return registry.get_sample_value(name) or 0.0


wait_until = functools.partial(wait_for_async, timeout=5.0, what="Redis to be back in use")


async def shared_match(server: RedisServer, keys: Sequence[int]) -> PrefixMatch:
    """What another gateway replica reads from Redis."""
    replica = RedisStore(server.url, namespace=NS)
    try:
        return await replica.match(keys, 16)
    finally:
        await replica.close()


async def test_crashed_redis_is_served_from_local_view_and_caught_up_after_restart(
    store: ResilientStore, server: RedisServer, registry: CollectorRegistry
) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:4])])
    assert (await store.match(K, 16)).pods == {"a": PodPrefix(4, 4)}
    assert counter(registry, "kvgate_index_fallbacks_total") == 0

    server.kill()
    crashed = await store.match(K, 16)
    await store.apply("a", [Stored(Tier.L0, K[4:6])])  # no exception while down
    while_down = await store.match(K, 16)

    assert crashed.pods == {"a": PodPrefix(4, 4)}
    assert while_down.pods == {"a": PodPrefix(6, 6)}
    assert not store.using_redis
    assert counter(registry, "kvgate_index_fallbacks_total") == 2
    assert counter(registry, "kvgate_index_redis_errors_total") >= 1
    assert counter(registry, "kvgate_index_redis_up") == 0

    server.start()  # same port, empty: the restarted Redis lost everything
    await wait_until(lambda: store.using_redis)

    replica = RedisStore(server.url, namespace=NS)  # another gateway replica
    try:
        assert (await replica.match(K, 16)).pods == {"a": PodPrefix(6, 6)}  # caught up
        await replica.apply("b", [Stored(Tier.L1, K[:2])])
        fallbacks = counter(registry, "kvgate_index_fallbacks_total")

        # only Redis knows about b, so this answer proves lookups use Redis again
        assert (await store.match(K, 16)).pods == {"a": PodPrefix(6, 6), "b": PodPrefix(0, 2)}
        assert counter(registry, "kvgate_index_fallbacks_total") == fallbacks
        assert counter(registry, "kvgate_index_redis_up") == 1
    finally:
        await replica.close()


async def test_breaker_keeps_lookups_off_a_dead_redis(
    store: ResilientStore, server: RedisServer, registry: CollectorRegistry
) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:4])])
    server.kill()
    await store.match(K, 16)  # trips the breaker

    start = time.perf_counter()
    for _ in range(200):
        assert (await store.match(K, 16)).pods == {"a": PodPrefix(4, 4)}
    elapsed = time.perf_counter() - start

    # Local answers: a round trip each to a dead Redis (a refused connect, or the 100 ms
    # socket timeout) would show in the error counter below; the time bound only catches
    # a lookup waiting on Redis, with room for a CI box running vLLM pods beside it.
    assert elapsed < 1.0
    # only the background probe (20 ms backoff, doubling) touches Redis meanwhile
    assert counter(registry, "kvgate_index_redis_errors_total") < 20


async def test_hung_redis_costs_one_socket_timeout_then_replays_buffered_events(
    store: ResilientStore, server: RedisServer
) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:6])])
    server.pause()

    start = time.perf_counter()
    first = await store.match(K, 16)
    first_s = time.perf_counter() - start
    await store.apply("a", [Removed(Tier.L0, K[3:4])])

    assert first.pods == {"a": PodPrefix(6, 6)}
    # One 100 ms socket timeout, not redis-py's unbounded wait (plus a loaded CI box)
    assert first_s < 1.0
    assert (await store.match(K, 16)).pods == {"a": PodPrefix(3, 3)}

    server.resume()  # same process: no data lost, the buffered removal is replayed
    await wait_until(lambda: store.using_redis)

    replica = RedisStore(server.url, namespace=NS)
    try:
        assert (await replica.match(K, 16)).pods == {"a": PodPrefix(3, 3)}
    finally:
        await replica.close()


async def test_drop_pod_while_down_reaches_redis_after_recovery(
    store: ResilientStore, server: RedisServer
) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:4])])
    await store.apply("b", [Stored(Tier.L0, K[:2])])
    server.pause()
    await store.match(K, 16)

    await store.drop_pod("a")
    server.resume()
    await wait_until(lambda: store.using_redis)

    assert (await store.match(K, 16)).pods == {"b": PodPrefix(2, 2)}


async def test_redis_that_was_never_up_is_no_error(registry: CollectorRegistry) -> None:
    primary = RedisStore(f"redis://127.0.0.1:{free_port()}/0", namespace=NS)
    store = ResilientStore(primary, MemoryStore(100), ResilientMetrics(registry))
    try:
        await store.apply("a", [Stored(Tier.L0, K[:2])])
        await store.speculate("b", K[:1], ttl_s=60)
        await store.drop_pod("c")

        m = await store.match(K, 16)
        stats = await store.stats()

        assert m.pods == {"a": PodPrefix(2, 2), "b": PodPrefix(1, 1)}
        assert (stats.backend, stats.keys) == ("memory", 2)
        assert not store.using_redis
    finally:
        await store.close()


async def test_a_failed_write_reaches_redis_though_the_first_snapshot_push_failed_too(
    store: ResilientStore, server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_apply = store.primary.apply
    calls = 0

    async def apply_failing_twice(pod: str, ops: Sequence[IndexOp]) -> None:
        nonlocal calls
        calls += 1
        if calls <= 2:  # the event's own write, then the first push of the snapshot
            raise RedisTimeoutError("injected")
        await real_apply(pod, ops)

    monkeypatch.setattr(store.primary, "apply", apply_failing_twice)

    await store.apply("a", [Stored(Tier.L0, K[:4])])
    assert not store.using_redis
    await wait_until(lambda: store.using_redis)

    local = store.local.match_now(K, 16)
    assert local.pods == {"a": PodPrefix(4, 4)}
    assert (await shared_match(server, K)).pods == local.pods
    assert calls > 2  # the snapshot was pushed again after its first push failed


async def test_a_redis_restart_that_no_call_noticed_is_resynced_from_the_local_view(
    store: ResilientStore, server: RedisServer
) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:4])])
    assert (await shared_match(server, K)).pods == {"a": PodPrefix(4, 4)}

    # Same port, data lost; no call of the store fails (its pooled connection would be
    # retried transparently), so only the server's changed identity can tell.
    server.restart()
    deadline = time.monotonic() + 5.0
    while (await shared_match(server, K)).pods != {"a": PodPrefix(4, 4)}:
        assert time.monotonic() < deadline, "Redis never got the local view back"
        await asyncio.sleep(0.05)

    await wait_until(lambda: store.using_redis)


async def test_a_lookup_that_fails_unexpectedly_is_answered_from_the_local_view(
    store: ResilientStore, registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:4]), Stored(Tier.L2, K[:2])])

    async def broken(*args: object) -> None:
        raise ValueError("not a Redis error: a value nobody expected, or a bug")

    monkeypatch.setattr(store.primary, "match", broken)
    monkeypatch.setattr(store.primary, "l2_writers", broken)

    assert (await store.match(K, 16)).pods == {"a": PodPrefix(4, 4)}
    assert await store.l2_writers(K) == {"a": 2}
    assert counter(registry, "kvgate_index_fallbacks_total") >= 1
    assert counter(registry, "kvgate_index_redis_errors_total") >= 1


async def test_a_block_value_apply_cannot_decode_is_overwritten_not_an_error(
    store: ResilientStore, registry: CollectorRegistry
) -> None:
    primary = store.primary
    for key in K[:3]:  # corrupt, or written by another version: no "|" after the writer
        await primary.client.set(primary.key_name(key), b"garbage")

    await store.apply("a", [Stored(Tier.L0, K[:1])])
    await store.speculate("b", K[1:2], ttl_s=60)
    await store.apply("c", [Cleared((Tier.L0,))])  # SCANs every block key: K[2] too

    assert store.using_redis
    assert counter(registry, "kvgate_index_redis_errors_total") == 0
    assert await primary.client.get(primary.key_name(K[0])) == f"|{primary.pod_id('a')}=1".encode()
    speculated = await primary.client.get(primary.key_name(K[1]))
    assert speculated.startswith(f"|{primary.pod_id('b')}=".encode())
    assert await primary.client.get(primary.key_name(K[2])) is None  # nobody holds it
