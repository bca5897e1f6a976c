"""Fuzz: no input makes decoding, translation or the subscriber's frame handling raise."""

import asyncio

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.events.http_ingest import BadEventsBody, decode_http_events
from kvindex.events.ingest import PodIngestor
from kvindex.events.subscriber import KVEventSubscriber
from kvindex.events.translate import EventTranslator
from kvindex.events.vllm_adapter import MalformedPayload, batch_from_obj, decode_payload
from kvindex.keyer import BlockKeyer
from tests.recording_store import RecordingStore

KEYER = BlockKeyer("fuzz", 4)
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU", "STORAGE"])
)
anything = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=6), kids, max_size=6)
    ),
    max_leaves=40,
)
hashes = st.lists(st.integers(0, 5) | st.binary(min_size=1, max_size=2), min_size=1, max_size=4)
near_valid_event = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("BlockStored"),
            "block_hashes": hashes,
            "parent_block_hash": st.none() | st.integers(0, 5),
            "token_ids": st.lists(st.integers(-1, 2**33), max_size=16),
            "block_size": st.integers(-1, 8),
            "medium": st.sampled_from(["GPU", "CPU", "cpu", "STORAGE", None, "X"]),
            "locality": st.sampled_from(["LOCAL", "REMOTE", None]),
            "lora_name": st.none() | st.text(max_size=3),
            "extra_keys": st.none() | st.lists(anything, max_size=3),
            "group_idx": st.none() | st.integers(0, 2),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("BlockRemoved"),
            "block_hashes": hashes,
            "medium": st.sampled_from(["GPU", "CPU", None]),
        }
    ),
    st.just({"type": "AllBlocksCleared"}),
    anything,
)
batches = st.tuples(
    st.floats(allow_nan=False) | st.integers(0, 10), st.lists(near_valid_event, max_size=8)
)


@FAST
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_malformed_payload(raw):
    try:
        decode_payload(raw)
    except MalformedPayload:
        pass


@FAST
@given(anything)
def test_random_msgpack_structures_decode_and_translate_without_raising(obj):
    try:
        batch = batch_from_obj(obj)
    except MalformedPayload:
        return
    EventTranslator("p", KEYER).translate(batch)


@FAST
@given(st.lists(batches, min_size=1, max_size=4))
def test_near_valid_batch_streams_translate_without_raising(stream):
    translator = EventTranslator("p", KEYER)
    for ts, events in stream:
        translator.translate(batch_from_obj([ts, events, 0]))


@FAST
@given(anything, st.sampled_from(["application/json", "application/msgpack"]))
def test_http_decoder_raises_only_bad_events_body(obj, ctype):
    try:
        body = msgspec.msgpack.encode(obj) if "msgpack" in ctype else msgspec.json.encode(obj)
    except (TypeError, ValueError, OverflowError):
        return  # not representable in that encoding (e.g. bytes or NaN in JSON)
    try:
        decode_http_events(body, ctype)
    except BadEventsBody:
        pass


seqs = st.integers(0, 6) | st.just(2**64 - 2)
frames = st.one_of(
    st.lists(st.binary(max_size=12), max_size=4),
    st.tuples(st.just(b""), seqs.map(lambda s: s.to_bytes(8, "big")), st.binary(max_size=40)).map(
        list
    ),
    st.tuples(
        st.just(b""),
        seqs.map(lambda s: s.to_bytes(8, "big")),
        batches.map(lambda b: msgspec.msgpack.encode([b[0], b[1], 0])),
    ).map(list),
)


@FAST
@given(st.lists(frames, max_size=10))
def test_subscriber_frame_handling_never_raises(messages):
    async def run():
        store = RecordingStore()
        sub = KVEventSubscriber("p", "tcp://127.0.0.1:1", None, KEYER, store)
        for message in messages:
            await sub.handle_frames(message)
        return sub

    sub = asyncio.run(run())
    assert sub.stats[0]["internal_errors"] == 0


def test_ingestor_survives_a_store_that_raises():
    class Broken(RecordingStore):
        async def apply(self, pod, ops):
            raise ConnectionError("redis down")

    async def run():
        ing = PodIngestor("p", KEYER, Broken())
        return await ing.apply_payload(
            msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}]])
        ), ing

    ok, ing = asyncio.run(run())
    assert (ok, ing.store_errors) == (True, 1)
