"""Clumsy and hostile input gets a clear 4xx in the OpenAI shape and costs nothing else:
malformed content parts, token ids out of range, deep nesting, slow or huge headers,
slow bodies, long request ids, unknown paths. Real gateway, simulated pods."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.openai_errors import assert_openai_error
from tests.sim_gateway import model_env, sim_pods_and_gateway

MODEL = "kvgate-tiny-llama"
BLOCK = 32


@pytest.fixture(scope="module")
def gateway():
    """kv-aware with a local tokenizer, short client deadlines, events on."""
    env = model_env(KVGATE_TIMEOUTS__CLIENT_HEADERS_S="1", KVGATE_TIMEOUTS__CLIENT_BODY_S="1")
    with sim_pods_and_gateway(2, "kv-aware", env) as (_, gw):
        yield gw


def _chat(content: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}


@pytest.mark.parametrize(
    "parts",
    [
        [{"type": "text", "text": None}],
        [{"type": "text", "text": 7}],
        [{"type": "text", "text": True}],
        [{"type": "text"}],
        [{"text": "no type"}],
        ["a bare string"],
        [None],
    ],
)
def test_malformed_content_parts_are_400_naming_messages(gateway, parts):
    r = httpx.post(f"{gateway}/v1/chat/completions", json=_chat(parts))
    assert_openai_error(r, 400, param="messages")


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_token_ids_outside_uint32_are_400_under_kv_aware(gateway, bad):
    prompt = list(range(40)) + [bad]
    r = httpx.post(f"{gateway}/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert_openai_error(r, 400, param="prompt")
    batch = {"model": MODEL, "prompt": [list(range(40)), [bad]]}
    assert_openai_error(httpx.post(f"{gateway}/v1/completions", json=batch), 400, param="prompt")


def test_json_nested_ten_thousand_deep_is_400_on_serving_and_admin(gateway):
    deep = b'{"model":"m","x":' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    err = assert_openai_error(httpx.post(f"{gateway}/v1/chat/completions", content=deep), 400)
    assert "nested" in err["message"]
    assert_openai_error(httpx.post(f"{gateway.admin}/admin/index/lookup", content=deep), 400)


def test_a_well_formed_request_still_works_after_the_bad_ones(gateway):
    r = httpx.post(f"{gateway}/v1/chat/completions", json=_chat([{"type": "text", "text": "hi"}]))
    assert r.status_code == 200, r.text


def _raw(gateway: str, payload: bytes, wait_s: float = 0.0) -> tuple[bytes, float]:
    """Send raw bytes, (optionally) stall, and read until the server closes."""
    host, port = gateway.split("//")[1].split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        time.sleep(wait_s)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks), time.monotonic() - started


def test_a_client_trickling_its_headers_is_cut_off_with_408(gateway):
    reply, took = _raw(gateway, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert took < 5  # the header deadline is 1 s here
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 408


def test_a_silent_connection_is_closed_at_the_header_deadline(gateway):
    reply, took = _raw(gateway, b"")
    assert reply.startswith(b"HTTP/1.1 408") and took < 5


def test_a_megabyte_of_headers_is_431(gateway):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    reply, _ = _raw(gateway, head)
    assert reply.startswith(b"HTTP/1.1 431"), reply[:200]


def test_a_body_that_never_finishes_is_408(gateway):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: 1000\r\n\r\n{\"model\":")  # fmt: skip
    reply, took = _raw(gateway, head)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert took < 5


def test_a_long_or_odd_request_id_is_replaced_not_reflected(gateway):
    for given in ("x" * 5000, "a b\tc", "<script>"):
        r = httpx.post(f"{gateway}/v1/completions", content=b"[", headers={"x-request-id": given})
        assert r.headers["x-request-id"] != given and len(r.headers["x-request-id"]) == 32
    r = httpx.post(f"{gateway}/v1/completions", content=b"[", headers={"x-request-id": "req-42.a"})
    assert r.headers["x-request-id"] == "req-42.a"


@pytest.mark.parametrize(("method", "path"), [("GET", "/nope"), ("GET", "/v1/chat/completions"),
                                              ("DELETE", "/v1/models")])  # fmt: skip
def test_unknown_paths_and_methods_answer_in_the_openai_shape(gateway, method, path):
    r = httpx.request(method, f"{gateway}{path}")
    assert_openai_error(r, 404 if path == "/nope" else 405)
