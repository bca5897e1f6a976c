"""vLLM KV-event payloads → EngineBatch: both event shapes, both hash shapes."""

from typing import Any

import msgspec
import pytest

from kvindex.events.types import EngineBatch, EngineCleared, EngineRemoved, EngineStored
from kvindex.events.vllm_adapter import MalformedPayload, decode_payload, tier_of
from kvindex.types import Tier

# Encoded by vLLM 0.32.0's own classes (vllm.distributed.kv_events.KVEventBatch):
# BlockStored(block_hashes=[2**64-1, 5], parent None, tokens 0..63, block_size 32,
# medium GPU, extra_keys [("salt1",), None], group_idx 0), BlockRemoved([5], GPU),
# AllBlocksCleared(); ts 1.5, data_parallel_rank 0.
VLLM_0_32_PAYLOAD = bytes.fromhex(
    "93cb3ff8000000000000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368"
    "657392cfffffffffffffffff05b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69"
    "6473dc0040000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122"
    "232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3faa626c6f636b5f73697a65"
    "20a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b"
    "6579739291a573616c7431c0a967726f75705f6964780083a474797065ac426c6f636b52656d6f76"
    "6564ac626c6f636b5f6861736865739105a66d656469756da347505581a474797065b0416c6c426c"
    "6f636b73436c656172656400"
)


# vLLM <= 0.23: the same classes declared array_like=True, tag=True (positional arrays).
class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(OldEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(OldEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(OldEvent):
    pass


def test_vllm_0_32_tagged_maps_decode_field_by_field():
    batch = decode_payload(VLLM_0_32_PAYLOAD)
    assert batch == EngineBatch(
        ts=1.5,
        dp_rank=0,
        events=[
            EngineStored(
                hashes=[2**64 - 1, 5],
                parent=None,
                token_ids=list(range(64)),
                block_size=32,
                medium="GPU",
                extra_keys=[["salt1"], None],
                group_idx=0,
            ),
            EngineRemoved(hashes=[5], medium="GPU"),
            EngineCleared(),
        ],
    )


def test_positional_arrays_with_the_tag_first_decode_like_maps():
    payload = msgspec.msgpack.encode(
        OldBatch(
            ts=2.0,
            events=[
                BlockStored([b"\x01" * 32], b"\x02" * 32, [1, 2, 3, 4], 4, None, "CPU", "ad"),
                BlockRemoved([b"\x01" * 32], "CPU", 1),
                AllBlocksCleared(),
            ],
        )
    )
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # really positional
    assert decode_payload(payload) == EngineBatch(
        ts=2.0,
        events=[
            EngineStored(
                hashes=[b"\x01" * 32],
                parent=b"\x02" * 32,
                token_ids=[1, 2, 3, 4],
                block_size=4,
                medium="CPU",
                lora_name="ad",
            ),
            EngineRemoved(hashes=[b"\x01" * 32], medium="CPU", group_idx=1),
            EngineCleared(),
        ],
    )


def test_oldest_positional_block_stored_without_medium_is_accepted():
    payload = msgspec.msgpack.encode([0.5, [["BlockStored", [7], None, [1, 2], 2]]])
    (event,) = decode_payload(payload).events
    assert event == EngineStored(hashes=[7], parent=None, token_ids=[1, 2], block_size=2)


def test_negative_int_hashes_from_signed_python_hash_wrap_to_uint64():
    payload = msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [-1]}]])
    assert decode_payload(payload).events == [EngineRemoved(hashes=[2**64 - 1])]


def test_unknown_fields_are_ignored_and_unknown_types_counted_as_ignored():
    events = [
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "future": {"x": 1}},
        {"type": "BlockPinned", "block_hashes": [1]},
        ["SomethingNew", 1, 2],
    ]
    batch = decode_payload(msgspec.msgpack.encode([0.0, events, 3]))
    assert batch.events == [EngineRemoved(hashes=[1], medium="GPU")]
    assert (batch.ignored, batch.malformed, batch.dp_rank) == (2, 0, 3)


@pytest.mark.parametrize(
    "bad_event",
    [
        {"type": "BlockStored", "block_hashes": [1]},  # no token_ids
        {"type": "BlockStored", "block_hashes": [], "token_ids": [], "block_size": 0},
        {"type": "BlockRemoved", "block_hashes": [1.5]},
        {"type": "BlockRemoved", "block_hashes": [True]},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": "x", "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": -1},
        ["BlockStored", [1], None],  # positional, too short
        {"no": "type"},
        42,
        [],
    ],
)
def test_a_malformed_event_is_counted_and_the_rest_of_the_batch_kept(bad_event):
    good = {"type": "AllBlocksCleared"}
    batch = decode_payload(msgspec.msgpack.encode([0.0, [bad_event, good]]))
    assert batch.events == [EngineCleared()]
    assert batch.malformed == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x93\x01",
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode(7),
        msgspec.msgpack.encode(["ts", [], 0]),
        msgspec.msgpack.encode([1.0, "events", 0]),
    ],
)
def test_a_payload_that_is_not_a_batch_raises_malformed_payload(payload):
    with pytest.raises(MalformedPayload):
        decode_payload(payload)


def test_msgpack_nested_deeper_than_the_interpreter_allows_is_malformed():
    nested = b"\x91" * 200_000 + b"\x00"  # 200,000 one-element arrays around a 0
    with pytest.raises(MalformedPayload):
        decode_payload(nested)


def test_a_map_shaped_batch_from_intermediate_releases_is_accepted():
    payload = msgspec.msgpack.encode(
        {"ts": 3.0, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1}
    )
    assert decode_payload(payload) == EngineBatch(ts=3.0, events=[EngineCleared()], dp_rank=1)


@pytest.mark.parametrize(
    ("medium", "locality", "tier"),
    [
        ("GPU", None, Tier.L0),
        (None, None, Tier.L0),
        ("CPU", None, Tier.L1),
        ("cpu", None, Tier.L1),
        ("STORAGE", "REMOTE", Tier.L2),
        ("STORAGE", "LOCAL", Tier.L1),
        ("STORAGE", None, Tier.L1),
        ("NVME_OF_THE_FUTURE", None, None),
    ],
)
def test_medium_and_locality_map_to_tiers(medium, locality, tier):
    assert tier_of(medium, locality) is tier
