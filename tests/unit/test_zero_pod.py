"""The zero-latency backend's request handling (``bench.zero_pod``), without sockets."""

import json

import pytest

from bench.zero_pod import _completion, wants_stream


@pytest.mark.parametrize(
    ("body", "stream"),
    [
        (b'{"model":"m","stream":true}', True),
        (b'{"model": "m", "stream": true}', True),
        (b'{"stream" :\n true, "model": "m"}', True),
        (b'{"model": "m", "stream": false}', False),
        (b'{"model": "m"}', False),
        # a quoted "stream" inside a message is escaped, so it is not the key
        (b'{"messages":[{"content":"say \\"stream\\": true"}],"stream":false}', False),
        (bytearray(b'{"model":"m","stream":true}'), True),
    ],
)
def test_a_body_asks_for_a_stream_only_with_stream_true(body, stream):
    assert wants_stream(body) is stream


def test_completions_are_whole_responses_kept_per_stream_and_length():
    plain = _completion(False, 123)
    assert plain is _completion(False, 123)  # built once
    head, _, payload = plain.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head
    assert f"content-length: {len(payload)}".encode() in head
    assert json.loads(payload)["usage"]["prompt_tokens"] == 123
    sse = _completion(True, 123)
    assert b"text/event-stream" in sse and sse.endswith(b"data: [DONE]\n\n")
    assert _completion(False, 124) != plain
