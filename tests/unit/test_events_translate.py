"""Engine events → router-key ops: keys learnt from events equal BlockKeyer keys."""

import logging

import msgspec
from prometheus_client import CollectorRegistry

from kvindex.events.engine_map import EngineKeyMap
from kvindex.events.ingest import PodIngestor
from kvindex.keyer import BlockKeyer
from kvindex.metrics import EventMetrics
from kvindex.store import Cleared, Removed, Stored
from kvindex.types import Tier
from tests.recording_store import RecordingStore

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks of 4
KEYER = BlockKeyer("tiny", BS)


def stored(hashes, parent, tokens, medium="GPU", block_size=BS, **extra):
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }
    event.update(extra)
    return event


def removed(hashes, medium="GPU", **extra):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, **extra}


def payload(*events):
    return msgspec.msgpack.encode([0.0, list(events), 0])


def setup(pod="p"):
    registry = CollectorRegistry()
    store = RecordingStore()
    return PodIngestor(pod, KEYER, store, EventMetrics(registry)), store, registry


def sample(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


async def test_keys_learnt_from_chained_events_equal_blockkeyer_keys():
    ing, store, _ = setup()
    await ing.apply_payload(payload(stored([11, 12], None, TOKENS[:8])))
    await ing.apply_payload(payload(stored([13, 14, 15, 16], 12, TOKENS[8:])))
    keys = KEYER.keys(TOKENS)
    assert store.ops() == [Stored(Tier.L0, keys[:2]), Stored(Tier.L0, keys[2:])]


async def test_each_batch_becomes_one_apply_call_with_merged_ops():
    ing, store, _ = setup()
    await ing.apply_payload(payload(stored([11], None, TOKENS[:4]), stored([12], 11, TOKENS[4:8])))
    assert list(store.calls) == [("p", [Stored(Tier.L0, KEYER.keys(TOKENS[:8]))])]


async def test_cache_salt_in_first_block_extra_keys_seeds_the_root():
    ing, store, _ = setup()
    extra = [["s3cret"], None]
    await ing.apply_payload(payload(stored([1, 2], None, TOKENS[:8], extra_keys=extra)))
    assert store.ops() == [Stored(Tier.L0, KEYER.keys_for(TOKENS[:8], None, "s3cret"))]


async def test_lora_name_seeds_the_root_and_is_not_mistaken_for_the_salt():
    ing, store, _ = setup()
    lora_only = stored([1], None, TOKENS[:4], lora_name="ad", extra_keys=[["ad"]])
    both = stored([2], None, TOKENS[4:8], lora_name="ad", extra_keys=[["ad", [b"mm", 0], "s"]])
    await ing.apply_payload(payload(lora_only, both))
    assert store.ops() == [
        Stored(
            Tier.L0, KEYER.keys_for(TOKENS[:4], "ad", None) + KEYER.keys_for(TOKENS[4:8], "ad", "s")
        )
    ]


async def test_bytes_hashes_map_like_int_hashes():
    ing, store, _ = setup()
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    await ing.apply_payload(payload(stored([h1], None, TOKENS[:4]), stored([h2], h1, TOKENS[4:8])))
    await ing.apply_payload(payload(removed([h2])))
    keys = KEYER.keys(TOKENS[:8])
    assert store.ops() == [Stored(Tier.L0, keys), Removed(Tier.L0, [keys[1]])]


async def test_a_bytes_hash_longer_than_any_digest_is_malformed_and_never_kept():
    ing, store, registry = setup()
    huge = b"\x01" * 1_000_000  # would pin a megabyte per engine-map entry
    await ing.apply_payload(payload(stored([huge], None, TOKENS[:4])))
    assert store.ops() == []
    assert len(ing.translator(0).map) == 0
    assert ing.translator(0).stats.malformed == 1
    assert sample(registry, "kvgate_kv_event_decode_errors_total", pod="p") == 1


async def test_tokenless_offload_events_resolve_through_the_learnt_map():
    ing, store, _ = setup()
    await ing.apply_payload(payload(stored([1, 2], None, TOKENS[:8])))
    await ing.apply_payload(
        payload(stored([2], None, [], "CPU", block_size=0), removed([1]), removed([2], "CPU"))
    )
    k = KEYER.keys(TOKENS[:8])
    assert store.ops()[1:] == [
        Stored(Tier.L1, [k[1]]),
        Removed(Tier.L0, [k[0]]),
        Removed(Tier.L1, [k[1]]),
    ]


async def test_storage_remote_is_l2_and_storage_local_is_per_pod_l1():
    ing, store, _ = setup()
    await ing.apply_payload(payload(stored([1, 2], None, TOKENS[:8])))
    await ing.apply_payload(
        payload(
            stored([1], None, [], "STORAGE", block_size=0, locality="REMOTE"),
            stored([2], None, [], "STORAGE", block_size=0, locality="LOCAL"),
        )
    )
    k = KEYER.keys(TOKENS[:8])
    assert store.ops()[1:] == [Stored(Tier.L2, [k[0]]), Stored(Tier.L1, [k[1]])]


async def test_all_blocks_cleared_drops_the_pods_l0_and_l1():
    ing, store, registry = setup()
    await ing.apply_payload(payload({"type": "AllBlocksCleared"}))
    assert store.ops() == [Cleared((Tier.L0, Tier.L1))]
    labels = {"type": "AllBlocksCleared", "medium": "none", "pod": "p"}
    assert sample(registry, "kvgate_kv_events_applied_total", **labels) == 1


async def test_applied_events_are_counted_every_time_per_type_and_medium():
    ing, _, registry = setup()
    await ing.apply_payload(payload(stored([1, 2], None, TOKENS[:8])))
    await ing.apply_payload(payload(stored([3], 2, TOKENS[8:12]), removed([1])))
    await ing.apply_payload(payload(stored([2], None, [], "CPU", block_size=0)))
    for medium in ("disk-42", "tape", "GPU"):  # unknown media are skipped, not counted
        await ing.apply_payload(payload(removed([3], medium=medium)))
        await ing.apply_payload(payload(stored([3], 2, TOKENS[8:12])))

    def applied(kind, medium):
        return sample(registry, "kvgate_kv_events_applied_total", type=kind, medium=medium, pod="p")

    assert applied("BlockStored", "GPU") == 5
    assert applied("BlockStored", "CPU") == 1
    assert (applied("BlockRemoved", "GPU"), applied("BlockRemoved", "other")) == (2, 0)
    assert ing.translator(0).stats.ignored == 2


async def test_unknown_hashes_are_counted_and_skipped():
    ing, store, registry = setup()
    await ing.apply_payload(payload(removed([404, 405]), stored([9], 404, TOKENS[:4])))
    assert store.ops() == []
    assert sample(registry, "kvgate_kv_unknown_hashes_total", pod="p") == 3


async def test_block_size_mismatch_is_counted_every_time_and_logged_once(caplog):
    ing, store, registry = setup()
    caplog.set_level(logging.WARNING)
    await ing.apply_payload(payload(stored([1], None, TOKENS[:3], block_size=3)))
    await ing.apply_payload(payload(stored([2], None, TOKENS[:3], block_size=3)))
    assert store.ops() == []
    assert sample(registry, "kvgate_kv_block_size_mismatches_total", pod="p") == 2
    assert sum("block size 3 differs" in r.getMessage() for r in caplog.records) == 1


async def test_engine_blocks_a_multiple_of_the_router_block_map_to_several_keys():
    ing, store, registry = setup()  # LMCache-like: engine blocks of 8 tokens, router blocks of 4
    await ing.apply_payload(payload(stored([1], None, TOKENS[:8], "cpu", block_size=8)))
    await ing.apply_payload(payload(stored([2], 1, TOKENS[8:16], "cpu", block_size=8)))
    await ing.apply_payload(payload(removed([1], "cpu")))
    k = KEYER.keys(TOKENS[:16])
    assert store.ops() == [Stored(Tier.L1, k[:2]), Stored(Tier.L1, k[2:]), Removed(Tier.L1, k[:2])]
    assert sample(registry, "kvgate_kv_block_size_mismatches_total", pod="p") == 2


async def test_token_count_not_matching_the_hashes_is_a_decode_error():
    ing, store, registry = setup()
    await ing.apply_payload(payload(stored([1, 2], None, TOKENS[:5])))
    assert store.ops() == []
    assert sample(registry, "kvgate_kv_event_decode_errors_total", pod="p") == 1


async def test_groups_other_than_the_indexed_one_are_ignored():
    ing, store, _ = setup()
    await ing.apply_payload(payload(stored([1], None, TOKENS[:4], group_idx=1)))
    assert store.ops() == []
    assert ing.translator(0).stats.ignored == 1


async def test_engine_restart_clears_the_pod_and_forgets_its_hashes():
    ing, store, registry = setup()
    await ing.apply_payload(payload(stored([1], None, TOKENS[:4])))
    await ing.engine_restarted(0)
    await ing.apply_payload(payload(removed([1])))
    assert store.ops() == [Stored(Tier.L0, KEYER.keys(TOKENS[:4])), Cleared((Tier.L0, Tier.L1))]
    assert sample(registry, "kvgate_kv_engine_restarts_total", pod="p") == 1
    assert sample(registry, "kvgate_kv_unknown_hashes_total", pod="p") == 1


async def test_malformed_payload_is_counted_and_nothing_applied():
    ing, store, registry = setup()
    assert await ing.apply_payload(b"\xc1garbage") is False
    assert list(store.calls) == []
    assert sample(registry, "kvgate_kv_event_decode_errors_total", pod="p") == 1


async def test_lag_histogram_observes_now_minus_batch_ts():
    registry = CollectorRegistry()
    ing = PodIngestor("p", KEYER, RecordingStore(), EventMetrics(registry), clock=lambda: 10.25)
    await ing.apply_payload(msgspec.msgpack.encode([10.0, [], 0]))
    assert registry.get_sample_value("kvgate_kv_event_lag_seconds_sum") == 0.25
    assert registry.get_sample_value("kvgate_kv_event_lag_seconds_count") == 1


def test_engine_key_map_evicts_the_least_recently_used_hash():
    m = EngineKeyMap(capacity=2)
    m.learn(1, 10, 0, 10, 10)
    m.learn(2, 20, 0, 20, 20)
    assert m.get(1) == 10  # 1 is now the most recent
    m.learn(3, 30, 0, 30, 30)
    assert (m.get(2), m.get(1), m.get(3), len(m), m.evictions) == (None, 10, 30, 2, 1)


async def test_the_map_entries_are_left_alone_by_the_garbage_collector():
    """A pod's map holds up to 262k entries: as objects, every full collection walked
    them all; as tuples of ints the collector stops tracking them."""
    import gc

    ing, _, _ = setup()
    await ing.apply_payload(payload(stored([11, 12], None, TOKENS[:8])))
    await ing.apply_payload(payload(stored([12], None, [], medium="CPU", block_size=0)))
    gc.collect()
    entries = [ing.translator().map.entry(h) for h in (11, 12)]
    assert all(e is not None and not gc.is_tracked(e) for e in entries)


async def test_a_hash_is_forgotten_once_no_tier_holds_its_block():
    """The map follows the pod's cache: it does not fill up with evicted blocks."""
    ing, store, _ = setup()
    await ing.apply_payload(payload(stored([11, 12], None, TOKENS[:8])))
    await ing.apply_payload(payload(stored([12], None, [], medium="CPU", block_size=0)))
    assert len(ing.translator().map) == 2
    await ing.apply_payload(payload(removed([11, 12])))  # GPU copies evicted
    assert len(ing.translator().map) == 1  # 12 is still in host memory
    await ing.apply_payload(payload(removed([12], medium="CPU")))
    assert len(ing.translator().map) == 0
    keys = KEYER.keys(TOKENS[:8])
    assert store.ops()[-2:] == [Removed(Tier.L0, keys), Removed(Tier.L1, keys[1:])]


async def test_all_blocks_cleared_forgets_hashes_held_only_by_the_pod():
    ing, _, _ = setup()
    await ing.apply_payload(payload(stored([11, 12], None, TOKENS[:8])))
    await ing.apply_payload(payload(stored([12], None, [], medium="STORAGE", block_size=0,
                                           locality="REMOTE")))  # fmt: skip
    await ing.apply_payload(payload({"type": "AllBlocksCleared"}))
    assert (ing.translator().map.get(11), ing.translator().map.get(12)) == (
        None,
        KEYER.keys(TOKENS[:8])[1],
    )


async def test_ops_carry_chain_positions_across_events_and_hash_only_events():
    """Depth, group anchor and parent follow the chain through parent hashes, so
    removals and tokenless offloads can name the groups they touch."""
    from kvindex.store import chain_positions

    tokens = list(range(1000, 1160))  # 40 blocks: groups of 16 start at blocks 0, 16, 32
    keys = KEYER.keys(tokens)
    want = chain_positions(keys)
    ing, store, _ = setup()
    hashes = list(range(500, 540))
    await ing.apply_payload(payload(stored(hashes[:10], None, tokens[:40])))
    await ing.apply_payload(payload(stored(hashes[10:25], hashes[9], tokens[40:100])))
    await ing.apply_payload(payload(stored(hashes[25:], hashes[24], tokens[100:])))
    await ing.apply_payload(payload(removed([hashes[20], hashes[3]])))
    await ing.apply_payload(payload(stored([hashes[33]], None, [], medium="CPU")))
    ops = store.ops()
    assert [op.keys for op in ops[:3]] == [keys[:10], keys[10:25], keys[25:]]
    got = [
        p
        for op in ops[:3]
        for p in zip(op.pos.offsets, op.pos.anchors, op.pos.parents, strict=True)
    ]
    assert got == list(zip(want.offsets, want.anchors, want.parents, strict=True))
    assert got[20] == (4, keys[16], keys[19]) and got[33] == (1, keys[32], keys[32])
    removal, offload = ops[3], ops[4]
    assert removal.keys == [keys[20], keys[3]]
    assert list(zip(removal.pos.offsets, removal.pos.anchors, strict=True)) == [
        (4, keys[16]),
        (3, keys[0]),
    ]
    assert (offload.tier, offload.keys, list(offload.pos.anchors)) == (
        Tier.L1,
        [keys[33]],
        [keys[32]],
    )


async def test_positions_of_engine_blocks_spanning_several_router_blocks():
    """LMCache-style chunks: one engine hash stands for 2 router blocks; a removal of
    it names both, with the offsets and anchors of each."""
    from kvindex.store import chain_positions

    tokens = list(range(2000, 2160))  # 40 router blocks of 4 = 20 engine blocks of 8
    keys = KEYER.keys(tokens)
    want = chain_positions(keys)
    ing, store, _ = setup()
    hashes = list(range(700, 720))
    await ing.apply_payload(payload(stored(hashes[:9], None, tokens[:72], block_size=8)))
    await ing.apply_payload(payload(stored(hashes[9:], hashes[8], tokens[72:], block_size=8)))
    await ing.apply_payload(payload(removed([hashes[10]])))
    first, second, removal = store.ops()
    assert first.keys + second.keys == keys
    got = [*first.pos.anchors, *second.pos.anchors]
    assert got == list(want.anchors)
    assert removal.keys == keys[20:22]
    assert list(removal.pos.offsets) == [4, 5]
    assert list(removal.pos.anchors) == [keys[16], keys[16]]
    assert list(removal.pos.parents) == [keys[19], keys[20]]
