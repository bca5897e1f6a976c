"""What travels with a request: its id both ways, the routing headers back, the body as is."""

from __future__ import annotations

import re

import pytest

from bench.tinymodel import ensure_tokenizer
from tests.inproc.harness import CHAT, STREAM_CHAT, inproc_gateway
from tests.inproc.scripted_pod import MODEL, SSE_DONE, answer, completion, delta, sse, stream


async def test_client_request_id_reaches_the_pod_and_comes_back(pod_a):
    async with inproc_gateway(pod_a) as g:
        r = await g.chat(headers={"x-request-id": "req-42"})
        assert r.headers["x-request-id"] == "req-42"
        assert pod_a.received[0].headers.get("x-request-id") == "req-42"


async def test_request_id_is_generated_when_absent_and_sent_both_ways(pod_a):
    async with inproc_gateway(pod_a) as g:
        first, second = await g.chat(), await g.chat()
        assert re.fullmatch(r"[0-9a-f]{32}", first.headers["x-request-id"])
        assert first.headers["x-request-id"] != second.headers["x-request-id"]
        sent = [p.headers.get("x-request-id") for p in pod_a.received]
        assert sent == [first.headers["x-request-id"], second.headers["x-request-id"]]


@pytest.mark.parametrize(
    ("body", "reply"),
    [(CHAT, answer(completion())), (STREAM_CHAT, stream([sse(delta("hi")), SSE_DONE]))],
    ids=["json", "stream"],
)
async def test_response_names_the_pod_and_the_strategy(pod_a, pod_b, body, reply):
    for pod in (pod_a, pod_b):
        pod.default = reply
    async with inproc_gateway(pod_a, pod_b) as g:
        responses = [await g.chat(body) for _ in range(2)]
        routed = [(r.headers["x-kvgate-pod"], r.headers["x-kvgate-strategy"]) for r in responses]
        assert routed == [("pod-a", "round-robin"), ("pod-b", "round-robin")]


async def test_client_body_bytes_reach_the_pod_unchanged(pod_a):
    # Odd spacing, key order, escapes, raw UTF-8, and fields only vLLM knows.
    raw = (
        b'{"messages":[{"role":"user","content":"caf\\u00e9 \xe2\x98\x95"}],  "model":'
        b' "scripted-model","cache_salt":"tenant-7","vllm_xargs":{"k":[1,2.50,null]},'
        b'"zzz_unknown":{"nested":true}}\n'
    )
    async with inproc_gateway(pod_a) as g:
        r = await g.client.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 200
        assert pod_a.received[0].body == raw
        assert pod_a.received[0].headers["content-type"] == "application/json"


async def test_the_ttft_prediction_error_is_observed_relative_to_the_observed_ttft(pod_a):
    pod_a.script(stream([b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'], delay_s=0.05))
    models = {MODEL: {"block_size": 32, "tokenizer": str(ensure_tokenizer())}}
    async with inproc_gateway(pod_a, strategy="kv-aware", models=models) as g:
        call = g.stream_chat()
        await call.finished()
        assert g.metric("kvgate_predicted_ttft_relative_error_count", strategy="kv-aware") == 1
        total = g.metric("kvgate_predicted_ttft_relative_error_sum", strategy="kv-aware")
        assert total > 0
