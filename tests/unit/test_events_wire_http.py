"""ZMQ framing (live, replay) and the HTTP body decoder."""

import json

import msgspec
import pytest

from kvindex.events.http_ingest import BadEventsBody, decode_http_events
from kvindex.events.types import EngineBatch, EngineCleared, EngineRemoved
from kvindex.events.wire import END_SEQ, Frame, parse_live, parse_replay, replay_request

SEQ7 = (7).to_bytes(8, "big")
END = END_SEQ.to_bytes(8, "big")


def test_live_frames_are_topic_seq_payload():
    assert parse_live([b"kv", SEQ7, b"p"]) == Frame(seq=7, payload=b"p", topic=b"kv")


@pytest.mark.parametrize(
    "frames", [[b"kv", SEQ7], [b"kv", b"\x07", b"p"], [b"kv", END, b""], [b"a", SEQ7, b"p", b"x"]]
)
def test_other_live_messages_are_rejected(frames):
    assert parse_live(frames) is None


def test_replay_request_is_empty_delimiter_and_big_endian_start_seq():
    assert replay_request(258) == [b"", b"\x00\x00\x00\x00\x00\x00\x01\x02"]


def test_replay_replies_of_vllm_0_26_and_later_carry_the_topic():
    assert parse_replay([b"", b"kv", SEQ7, b"p"]) == Frame(seq=7, payload=b"p", topic=b"kv")


def test_replay_replies_before_0_26_are_seq_and_payload():
    assert parse_replay([b"", SEQ7, b"p"]) == Frame(seq=7, payload=b"p")


def test_replay_end_marker_in_both_shapes():
    assert parse_replay([b"", b"", END, b""]).seq == END_SEQ
    assert parse_replay([b"", END, b""]).seq == END_SEQ


@pytest.mark.parametrize("frames", [[], [b""], [b"", b"x"], [b"", b"kv", b"short", b"p"]])
def test_malformed_replay_replies_are_rejected(frames):
    assert parse_replay(frames) is None


BATCH = [1.0, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}], 0]
EXPECTED = EngineBatch(ts=1.0, events=[EngineRemoved(hashes=[5], medium="GPU")], dp_rank=0)


def test_http_body_msgpack_single_batch():
    body = msgspec.msgpack.encode(BATCH)
    assert decode_http_events(body, "application/msgpack") == [EXPECTED]


def test_http_body_json_list_of_batches_with_hex_bytes_hashes():
    second = {"ts": 2.0, "events": [{"type": "BlockRemoved", "block_hashes": ["00ff"]}]}
    body = json.dumps([BATCH, second]).encode()
    assert decode_http_events(body, "application/json; charset=utf-8") == [
        EXPECTED,
        EngineBatch(ts=2.0, events=[EngineRemoved(hashes=[b"\x00\xff"])]),
    ]


def test_http_body_all_blocks_cleared_in_json():
    body = json.dumps([0, [{"type": "AllBlocksCleared"}]]).encode()
    assert decode_http_events(body, "application/json") == [
        EngineBatch(ts=0.0, events=[EngineCleared()])
    ]


@pytest.mark.parametrize(
    ("body", "ctype"),
    [
        (b"{not json", "application/json"),
        (b"[1, 2]", "application/json"),
        (b"\xc1", "application/msgpack"),
        (msgspec.msgpack.encode(BATCH), "text/plain"),
        (b"[" * 100_000 + b"]" * 100_000, "application/json"),
    ],
)
def test_http_bodies_that_are_not_batches_raise_bad_events_body(body, ctype):
    with pytest.raises(BadEventsBody):
        decode_http_events(body, ctype)
