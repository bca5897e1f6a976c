"""RedisStore lookups (pipelined TIME + MGET, walk in Python) against a real redis-server.

The walk must be exact for any history, not only for the benchmark's prompts:
random event histories are replayed into a RedisStore and a MemoryStore and
every lookup must agree. The raw pipeline must never leave a reply unread on a
pooled connection, whatever happens to the caller.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.exceptions import NoPermissionError

from kvindex.memory_store import MemoryStore
from kvindex.redis_store import RedisStore
from kvindex.store import Cleared, IndexOp, Removed, Stored
from kvindex.types import PodPrefix, Tier
from tests.redis_server import RedisServer, redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.redis
K = [0xC000 + i for i in range(64)]
PODS = ["a", "b", "c", "d"]


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:  # noqa: F811
    s = RedisStore(redis_server.url, namespace=f"l-{uuid.uuid4().hex[:8]}", key_ttl_s=60)
    yield s
    await s.close()


def _random_op(rng: random.Random) -> IndexOp | tuple[str, list[int]]:
    """A Stored/Removed over a random slice of K (runs of equal values, gaps,
    values that recur further on), now and then a Cleared or a speculation."""
    start = rng.randrange(len(K))
    keys = K[start : start + rng.randrange(1, 40)]
    roll = rng.random()
    if roll < 0.05:
        return Cleared(tuple(rng.sample(list(Tier), rng.randint(1, 3))))
    if roll < 0.15:
        return ("speculate", keys)
    kind = Stored if roll < 0.75 else Removed
    return kind(rng.choice(list(Tier)), keys)


@pytest.mark.parametrize("seed", range(6))
async def test_lookups_agree_with_memory_store_after_random_histories(
    store: RedisStore, seed: int
) -> None:
    rng = random.Random(seed)
    memory = MemoryStore(capacity_keys=10_000)
    for _ in range(80):
        pod, op = rng.choice(PODS), _random_op(rng)
        for s in (memory, store):
            if isinstance(op, tuple):
                await s.speculate(pod, op[1], ttl_s=60)
            else:
                await s.apply(pod, [op])

    for start in (0, 1, 5, 17, 40):
        for end in (start + 1, start + 8, len(K)):
            keys = K[start:end]
            assert await store.match(keys, 16) == await memory.match(keys, 16), (start, end)
            assert await store.l2_writers(keys) == await memory.l2_writers(keys), (start, end)


async def test_a_block_held_only_by_expired_speculation_ends_every_chain(
    store: RedisStore,
) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:6]), Stored(Tier.L2, K[:6])])
    # what APPLY leaves between the deadline and the key's own expiry: one pod
    # whose speculative L0 ran out in 1970, no confirmed tier, no L2 copy
    await store.client.set(store.key_name(K[3]), f"|{store.pod_id('a')}={4 * 1000}")

    m = await store.match(K[:6], 16)

    assert (m.pods, m.l2) == ({"a": PodPrefix(3, 3)}, 3)


async def test_a_replica_reads_a_pod_name_from_the_registry_only_once(
    store: RedisStore,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    await store.apply("writer-pod", [Stored(Tier.L0, K[:4])])
    reader = RedisStore(redis_server.url, namespace=store.namespace)
    try:
        await store.client.config_resetstat()

        first = await reader.match(K[:4], 16)
        second = await reader.match(K[:4], 16)

        stats = await store.client.info("commandstats")
        assert first.pods == second.pods == {"writer-pod": PodPrefix(4, 4)}
        assert (stats["cmdstat_mget"]["calls"], stats["cmdstat_hmget"]["calls"]) == (2, 1)
    finally:
        await reader.close()


async def test_cancelled_lookups_never_leave_a_reply_for_the_next_caller(
    store: RedisStore,
) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:40])])
    await store.apply("b", [Stored(Tier.L1, K[:10])])

    cancelled = 0
    for i in range(40):  # cancel before the send, mid-flight, or not at all
        try:
            await asyncio.wait_for(store.match(K[: 20 + i % 20], 16), timeout=i * 2e-5)
        except TimeoutError:
            cancelled += 1

    assert cancelled > 0
    long, short = await asyncio.gather(store.match(K, 16), store.match(K[:5], 16))
    assert long.pods == {"a": PodPrefix(40, 40), "b": PodPrefix(0, 10)}
    assert short.pods == {"a": PodPrefix(5, 5), "b": PodPrefix(0, 5)}


async def test_a_rejected_lookup_leaves_the_pooled_connection_in_sync(
    store: RedisStore,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """TIME is answered, MGET is refused: the unread state must not leak."""
    user = f"nomget-{uuid.uuid4().hex[:6]}"
    await store.client.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "+@all", "-mget")
    url = redis_server.url.replace("redis://", f"redis://{user}:pw@")
    limited = RedisStore(url, namespace=store.namespace)
    try:
        await store.apply("a", [Stored(Tier.L0, K[:3])])

        with pytest.raises(NoPermissionError):
            await limited.match(K[:3], 16)

        assert await limited.client.get(store.key_name(K[0])) is not None
        assert await limited.client.ping() is True
    finally:
        await limited.close()
        await store.client.execute_command("ACL", "DELUSER", user)
