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

import pytest
from redis.exceptions import NoPermissionError

from bench.redis_server import RedisServer
from kvindex.memory_store import MemoryStore
from kvindex.redis_store import RedisStore
from kvindex.store import Cleared, IndexOp, Positions, Removed, Stored, chain_positions
from kvindex.types import PodPrefix, Tier
from tests.conftest import RedisTarget

pytestmark = pytest.mark.redis
K = [0xC000 + i for i in range(64)]
PODS = ["a", "b", "c", "d"]


@pytest.fixture
def store(redis_store: RedisStore) -> RedisStore:
    return redis_store


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
    redis_target: RedisTarget,
) -> None:
    await store.apply("writer-pod", [Stored(Tier.L0, K[:4])])
    reader = redis_target.store(store.namespace)
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
    redis_server: RedisServer,
) -> None:
    """TIME is answered, MGET is refused: the unread state must not leak. (One server:
    ACL users are per node.)"""
    store = RedisStore(redis_server.url, namespace=f"t-{uuid.uuid4().hex[:8]}")
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
        await store.close()


def _chains(rng: random.Random, n: int = 8, max_len: int = 90) -> list[list[int]]:
    """Prompts as block-key chains that share prefixes (a tree), long enough for
    several 16-block groups, branching inside groups and at their edges."""
    chains: list[list[int]] = []
    for _ in range(n):
        base = rng.choice(chains)[: rng.randrange(0, 60)] if chains else []
        chains.append(base + [rng.getrandbits(64) for _ in range(rng.randrange(1, max_len))])
    return chains


def _positions(chain: list[int], indices: list[int]) -> Positions:
    whole = chain_positions(chain)
    return Positions(
        [whole.offsets[i] for i in indices],
        [whole.anchors[i] for i in indices],
        [whole.parents[i] for i in indices],
    )


def _positioned_op(rng: random.Random, chains: list[list[int]]) -> IndexOp | tuple[str, list[int]]:
    """What the event translator emits, with positions: stored runs along a chain
    (mostly from where a cached prefix ends to the prompt's end, mostly L0),
    removals (mostly leaf-first, some in the middle of a group); now and then a
    removal whose positions are unknown, a Cleared or a speculation."""
    chain = rng.choice(chains)
    tier = rng.choices(list(Tier), weights=(6, 3, 1))[0]
    roll = rng.random()
    if roll < 0.03:
        return Cleared(tuple(rng.sample(list(Tier), rng.randint(1, 3))))
    if roll < 0.1:
        return ("speculate", chain[: rng.randrange(1, len(chain) + 1)])
    if roll < 0.6:
        start = 0 if rng.random() < 0.5 else rng.randrange(len(chain))
        end = len(chain) if rng.random() < 0.7 else rng.randrange(start, len(chain)) + 1
        run = list(range(start, end))
        return Stored(tier, [chain[i] for i in run], _positions(chain, run))
    if rng.random() < 0.6:  # evict a tail, leaf first
        picked = list(range(len(chain) - 1, rng.randrange(len(chain)) - 1, -1))[:20]
    else:
        picked = rng.sample(range(len(chain)), rng.randint(1, min(4, len(chain))))
    keys = [chain[i] for i in picked]
    pos = None if rng.random() < 0.03 else _positions(chain, picked)
    return Removed(tier, keys, pos)


@pytest.mark.parametrize("seed", range(8))
async def test_summarized_lookups_agree_with_memory_store_after_chained_histories(
    store: RedisStore, seed: int
) -> None:
    """Group summaries must never claim more than the blocks hold: random histories
    of positioned ops over branching chains, then every prefix of every chain."""
    rng = random.Random(100 + seed)
    chains = _chains(rng)
    memory = MemoryStore(capacity_keys=10_000)
    summarized = 0
    for step in range(240):
        pod = rng.choice(PODS[:3])
        if step % 80 == 79:
            await memory.drop_pod(pod)
            await store.drop_pod(pod)
            continue
        op = _positioned_op(rng, chains)
        for s in (memory, store):
            if isinstance(op, tuple):
                await s.speculate(pod, op[1], ttl_s=60)
            else:
                await s.apply(pod, [op])
        if step % 20 == 19:  # check along the way, not only at the end
            for chain in chains:
                for end in {1, 15, 16, 17, 33, 47, 48, len(chain) // 2, len(chain)}:
                    keys = chain[:end]
                    assert await store.match(keys, 16) == await memory.match(keys, 16), end
                    assert await store.l2_writers(keys) == await memory.l2_writers(keys)
            summarized += len(await store.client.keys(store.summary_prefix + "*"))
    assert summarized > 20  # the histories did exercise group summaries


async def test_a_group_with_more_branches_than_a_member_can_list_stays_exact(
    store: RedisStore,
) -> None:
    """40 prompts share blocks 0-19 and branch inside group 1 (blocks 16-31): the
    shared members can list only 32 ends, so later branches get no summary (or
    take the place of ends whose summary is gone); a removal of a shared member
    must still reach every summary that includes it."""
    rng = random.Random(7)
    shared = [rng.getrandbits(64) for _ in range(20)]
    chains = [shared + [rng.getrandbits(64) for _ in range(20)] for _ in range(50)]
    memory = MemoryStore(capacity_keys=10_000)

    async def both(pod: str, op: IndexOp) -> None:
        await memory.apply(pod, [op])
        await store.apply(pod, [op])

    for chain in chains[:40]:
        await both("a", Stored(Tier.L0, chain, chain_positions(chain)))
    for chain in chains[:12]:  # evict some branches' tails, leaf first
        tail = list(range(39, 24, -1))
        await both("a", Removed(Tier.L0, [chain[i] for i in tail], _positions(chain, tail)))
    for chain in chains[40:]:
        await both("a", Stored(Tier.L0, chain, chain_positions(chain)))
    # group 0 (shared), and group 1 of the first 32 branches: the shared members'
    # lists are then full (the 12 evicted tails keep their summaries, which still
    # describe the blocks 16-24 held), so the last 18 branches get none
    summaries = len(await store.client.keys(store.summary_prefix + "*"))
    assert summaries == 1 + 32

    await both("a", Removed(Tier.L0, [shared[18]], _positions(shared, [18])))

    for chain in chains:
        assert await store.match(chain, 16) == await memory.match(chain, 16)
        assert (await store.match(chain, 16)).pods == {"a": PodPrefix(18, 18)}
