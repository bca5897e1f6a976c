"""RedisStore specifics against a real redis-server: key layout, TTLs, sharing, bad input."""

from __future__ import annotations

import re

import pytest
from redis.crc import key_slot

from bench.redis_server import RedisServer
from kvindex.redis_store import RedisStore
from kvindex.store import Cleared, Removed, Stored, chain_positions
from kvindex.types import PodPrefix, Tier
from tests.conftest import RedisTarget

pytestmark = pytest.mark.redis
K = [0xB000 + i for i in range(2048)]


@pytest.fixture
def store(redis_store: RedisStore) -> RedisStore:
    return redis_store


async def _names(store: RedisStore) -> list[bytes]:
    return [n async for n in store.client.scan_iter(match=store.prefix + "*", count=1000)]


async def test_block_keys_share_one_hash_tag_so_a_script_sees_one_slot(store: RedisStore) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:50]), Stored(Tier.L2, [0, 2**64 - 1])])

    names = await _names(store)

    assert len(names) == 52  # block keys; the pod registry hash is not under :b:
    pattern = re.compile(r"\{kvgate:" + re.escape(store.namespace) + r"\}:b:[0-9a-f]{16}")
    assert all(pattern.fullmatch(n.decode()) for n in names)
    assert {key_slot(n) for n in [*names, store.registry.encode()]} == {key_slot(names[0])}
    assert store.key_name(0xB000) == f"{{kvgate:{store.namespace}}}:b:000000000000b000"


async def test_every_stored_block_key_carries_the_configured_ttl(store: RedisStore) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:3]), Stored(Tier.L2, K[3:5])])

    ttls = [await store.client.pttl(store.key_name(k)) for k in K[:5]]

    assert all(55_000 < t <= 60_000 for t in ttls), ttls


async def test_speculation_only_keys_expire_with_the_speculation(store: RedisStore) -> None:
    await store.speculate("a", K[:2], ttl_s=0.5)

    ttl = await store.client.pttl(store.key_name(K[0]))

    assert 0 < ttl <= 500


async def test_removing_the_last_holder_deletes_the_key(store: RedisStore) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:2]), Stored(Tier.L2, K[:1])])
    await store.apply("b", [Removed(Tier.L2, K[:1])])
    await store.apply("a", [Removed(Tier.L0, K[:2])])

    assert await _names(store) == []


async def test_replicas_with_the_same_namespace_share_one_index(
    store: RedisStore,
    redis_target: RedisTarget,
) -> None:
    replica = redis_target.store(store.namespace)
    other_model = redis_target.store(store.namespace + "-other")
    try:
        await store.apply("a", [Stored(Tier.L0, K[:3])])

        assert (await replica.match(K[:8], 16)).pods == {"a": PodPrefix(3, 3)}
        assert (await other_model.match(K[:8], 16)).pods == {}
    finally:
        await replica.close()
        await other_model.close()


async def _reads(store: RedisStore, keys: list[int]) -> tuple[dict[str, int], int]:
    """Commands per name and keys read (hits + misses) by one ``match``."""
    await store.client.config_resetstat()
    await store.match(keys, 16)
    stats = await store.client.info("commandstats")
    info = await store.client.info("stats")
    calls = {name: s["calls"] for name, s in stats.items() if name != "cmdstat_config|resetstat"}
    return calls, info["keyspace_hits"] + info["keyspace_misses"]


async def test_lookup_of_2048_chained_keys_reads_group_summaries_in_one_round_trip(
    store: RedisStore,
) -> None:
    await store.apply("a", [Stored(Tier.L0, K, chain_positions(K))])

    calls, reads = await _reads(store, K)

    assert (await store.match(K, 16)).pods == {"a": PodPrefix(2048, 2048)}
    # one pipelined round trip, no script, no registry read (this replica registered
    # "a"): the server clock, and one MGET of the summary epoch, the summaries of
    # groups 1..127 and the 16 blocks of group 0
    assert calls == {"cmdstat_time": 1, "cmdstat_mget": 1}
    assert reads == 1 + 127 + 16


async def test_a_chain_ending_inside_a_summarized_group_needs_no_second_round_trip(
    store: RedisStore,
) -> None:
    await store.apply("a", [Stored(Tier.L0, K, chain_positions(K))])
    await store.apply("b", [Stored(Tier.L0, K[:1000], chain_positions(K[:1000]))])

    calls, reads = await _reads(store, K)

    # group 62's summary holds its blocks' values: b's chain ends at block 1000
    want = {"a": PodPrefix(2048, 2048), "b": PodPrefix(1000, 1000)}
    assert (await store.match(K, 16)).pods == want
    assert calls == {"cmdstat_time": 1, "cmdstat_mget": 1}
    assert reads == 1 + 127 + 16


async def test_a_prompt_that_leaves_the_stored_chain_mid_group_reads_that_group(
    store: RedisStore,
) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:1000], chain_positions(K[:1000]))])

    calls, reads = await _reads(store, K)  # blocks 1000.. were never stored: no summary

    assert (await store.match(K, 16)).pods == {"a": PodPrefix(1000, 1000)}
    assert calls == {"cmdstat_time": 1, "cmdstat_mget": 2}
    assert reads == 1 + 127 + 16 + 16  # + the blocks of group 62


async def test_without_positions_lookups_stay_exact_by_reading_the_blocks(
    store: RedisStore,
) -> None:
    await store.apply("a", [Stored(Tier.L0, K)])  # no positions: no summaries

    calls, reads = await _reads(store, K)

    assert (await store.match(K, 16)).pods == {"a": PodPrefix(2048, 2048)}
    # round 1, then group 1, group 2, then every block left
    assert calls == {"cmdstat_time": 1, "cmdstat_mget": 4}
    assert reads == 1 + 127 + 16 + 16 + 16 + 2048 - 3 * 16


async def test_a_removal_of_unknown_position_retires_every_summary(store: RedisStore) -> None:
    await store.apply("a", [Stored(Tier.L0, K, chain_positions(K))])
    await store.apply("a", [Removed(Tier.L0, [K[700]])])  # no positions: which group?

    assert (await store.match(K, 16)).pods == {"a": PodPrefix(700, 700)}
    assert await store.client.get(store.epoch_key) == b"1"


async def test_keys_out_of_range_are_counted_and_skipped(store: RedisStore) -> None:
    await store.apply("a", [Stored(Tier.L0, [K[0], -1, 2**64, K[1]])])

    assert store.bad_keys == 2
    assert (await store.match(K[:5], 16)).pods == {"a": PodPrefix(2, 2)}


async def test_values_hold_short_pod_ids_and_the_registry_names_them(store: RedisStore) -> None:
    pod = "vllm-llama-3-8b-instruct-7d9f8c6b5-x2x9z|;="  # long, with any characters
    await store.apply(pod, [Stored(Tier.L0, K[:2]), Stored(Tier.L2, K[:1])])

    pid = store.pod_id(pod)
    value = await store.client.get(store.key_name(K[0]))

    assert len(pid) == 8
    assert value == f"{pid}|{pid}=1".encode()
    assert await store.client.hgetall(store.registry) == {pid.encode(): pod.encode()}
    assert (await store.match(K[:2], 16)).pods == {pod: PodPrefix(2, 2)}
    assert await store.l2_writers(K[:2]) == {pod: 1}


async def test_drop_pod_removes_its_name_from_the_registry(store: RedisStore) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:2]), Stored(Tier.L2, K[:2])])
    await store.apply("b", [Stored(Tier.L0, K[:1])])

    await store.drop_pod("a")

    assert await store.client.hgetall(store.registry) == {store.pod_id("b").encode(): b"b"}
    assert await store.l2_writers(K[:2]) == {store.pod_id("a"): 2}  # the raw id remains


async def test_store_recovers_when_redis_forgot_its_scripts(store: RedisStore) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:2])])
    await store.client.script_flush()

    await store.apply("a", [Stored(Tier.L0, K[2:4])])
    await store.client.script_flush()

    assert (await store.match(K, 16)).pods == {"a": PodPrefix(4, 4)}


async def test_stats_report_the_dedicated_db_size(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url.replace("/0", "/5"), max_keys=1000)
    try:
        await store.client.flushdb()
        await store.apply("a", [Stored(Tier.L0, K[:3])])

        stats = await store.stats()

        # three block keys and the namespace's pod registry
        assert (stats.backend, stats.keys, stats.capacity) == ("redis", 4, 1000)
    finally:
        await store.close()


async def test_drop_pod_and_cleared_reach_the_group_summaries(store: RedisStore) -> None:
    pos = chain_positions(K)
    await store.apply("a", [Stored(Tier.L0, K, pos), Stored(Tier.L2, K[16:], pos.slice(16))])
    await store.apply("b", [Stored(Tier.L0, K, pos), Stored(Tier.L1, K, pos)])
    await store.apply("b", [Stored(Tier.L2, K[:16], pos.slice(0, 16))])

    await store.drop_pod("b")  # its L0/L1 go, the L2 it wrote stays
    m = await store.match(K, 16)
    assert (m.pods, m.l2) == ({"a": PodPrefix(2048, 2048)}, 2048)

    # a's L2 writes go: the chain ends where b's (group 0) end, though group 0's
    # blocks, read directly, say nothing about the groups after it
    await store.apply("a", [Cleared((Tier.L2,))])
    assert (await store.match(K, 16)).l2 == 16
    _, reads = await _reads(store, K)
    assert reads == 1 + 127 + 16  # still served from the summaries


# -- values no APPLY wrote (corruption, a foreign version): read as absent, never raised


async def test_a_tier_digit_that_is_not_ascii_reads_as_absent(store: RedisStore) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:3])])
    # '²' passes str.isdigit() but int() rejects it
    await store.client.set(store.key_name(K[1]), f"|{store.pod_id('a')}=²".encode())

    m = await store.match(K[:3], 16)

    assert m.pods == {"a": PodPrefix(1, 1)}


async def test_a_tier_number_too_long_for_int_reads_as_absent(store: RedisStore) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:2])])
    # more digits than int() accepts from a string (sys.int_info.default_max_str_digits)
    await store.client.set(store.key_name(K[1]), f"|{store.pod_id('a')}=" + "1" * 5000)

    m = await store.match(K[:2], 16)

    assert m.pods == {"a": PodPrefix(1, 1)}


async def test_a_value_without_the_writer_separator_reads_as_absent(store: RedisStore) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:2]), Stored(Tier.L2, K[:2])])
    await store.client.set(store.key_name(K[1]), b"garbage")

    m = await store.match(K[:2], 16)

    # not an L2 copy written by a pod named "garbage": nobody holds block 1
    assert (m.pods, m.l2) == ({"a": PodPrefix(1, 1)}, 1)
    assert await store.l2_writers(K[:2]) == {"a": 1}


async def test_a_summary_run_count_too_long_for_int_falls_back_to_the_blocks(
    store: RedisStore,
) -> None:
    keys = K[:32]
    await store.apply("a", [Stored(Tier.L0, keys, chain_positions(keys))])
    summary = store.summary_prefix + store.key_name(keys[-1])[len(store.prefix) :]
    epoch = (await store.client.get(summary)).partition(b"#")[0]
    await store.client.set(summary, epoch + b"#" + b"1" * 5000 + b"*x")

    assert (await store.match(keys, 16)).pods == {"a": PodPrefix(32, 32)}


async def test_a_registry_name_that_is_not_utf8_leaves_the_raw_id(
    store: RedisStore, redis_target: RedisTarget
) -> None:
    await store.apply("a", [Stored(Tier.L0, K[:2])])
    pid = store.pod_id("a")
    await store.client.hset(store.registry, pid, b"\xff\xfe")
    replica = redis_target.store(store.namespace)  # has not met "a": reads the registry
    try:
        assert (await replica.match(K[:2], 16)).pods == {pid: PodPrefix(2, 2)}
    finally:
        await replica.close()
