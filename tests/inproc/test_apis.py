"""Every API reaches the pod at its own path with the client's bytes; the gateway's own
errors come in the API's shape (Anthropic's on /v1/messages, OpenAI's elsewhere); usage
is counted from Responses and Anthropic bodies and streams as from chat."""

from __future__ import annotations

import json

import pytest

from tests.inproc.harness import ANTHROPIC, API_REQUESTS, inproc_gateway
from tests.inproc.scripted_pod import MODEL, answer, drop, sse, stream
from tests.openai_errors import (
    assert_anthropic_error,
    assert_anthropic_error_event,
    assert_openai_error,
    assert_openai_error_event,
)


@pytest.mark.parametrize("path", list(API_REQUESTS))
async def test_every_api_reaches_the_pod_at_its_path_with_the_clients_bytes(pod_a, path):
    async with inproc_gateway(pod_a) as g:
        request = g.client.build_request("POST", path, **API_REQUESTS[path])
        sent = request.read()
        r = await g.client.send(request)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-pod"] == "pod-a"
        got = pod_a.received[0]
        assert (got.path, got.body) == (path, sent)
        assert got.headers["content-type"] == request.headers["content-type"]


async def test_an_audio_form_is_routed_by_its_model_field(pod_a):
    form = {"model": "whisper-x", "stream": "false"}
    async with inproc_gateway(pod_a) as g:
        r = await g.client.post("/v1/audio/transcriptions", data=form,
                                files={"file": ("a.wav", b"RIFF", "audio/wav")})  # fmt: skip
        err = assert_openai_error(r, 404, param="model")
        assert "whisper-x" in err["message"] and pod_a.received == []
        r = await g.client.post("/v1/audio/transcriptions", content=b"not a form",
                                headers={"content-type": "application/json"})  # fmt: skip
        assert_openai_error(r, 400)


# -- errors in each API's shape ----------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
async def test_anthropic_endpoints_answer_the_gateways_errors_in_anthropics_shape(pod_a, path):
    async with inproc_gateway(pod_a) as g:
        unknown = await g.client.post(path, json={**ANTHROPIC, "model": "nope"})
        err = assert_anthropic_error(unknown, 404)
        assert err["type"] == "not_found_error" and MODEL in err["message"]
        not_json = await g.client.post(path, content=b"{", headers={"content-type": "x"})
        assert assert_anthropic_error(not_json, 400)["type"] == "invalid_request_error"
        no_messages = await g.client.post(path, json={"model": MODEL, "messages": "hi"})
        assert assert_anthropic_error(no_messages, 400)["type"] == "invalid_request_error"
        bad_block = await g.client.post(
            path, json={**ANTHROPIC, "messages": [{"role": "user", "content": [1]}]}
        )
        assert "content[0]" in assert_anthropic_error(bad_block, 400)["message"]
        assert pod_a.received == []


async def test_a_pod_failure_on_messages_is_an_anthropic_api_error(pod_a):
    pod_a.script(drop(), drop(), drop())
    async with inproc_gateway(pod_a) as g:
        r = await g.client.post("/v1/messages", json=ANTHROPIC)
        assert assert_anthropic_error(r, 502)["type"] == "api_error"


async def test_a_stream_breaking_on_messages_ends_with_an_anthropic_error_event(pod_a):
    start = b'event: message_start\ndata: {"type":"message_start"}\n\n'
    pod_a.script(stream([start], ending="break"))
    async with inproc_gateway(pod_a) as g:
        call = g.stream("/v1/messages", {**ANTHROPIC, "stream": True})
        await call.finished()
        assert call.chunks[0] == start
        assert assert_anthropic_error_event(call.chunks[-1])["type"] == "api_error"


async def test_a_stream_breaking_on_responses_ends_with_an_openai_error_event(pod_a):
    pod_a.script(stream([sse({"type": "response.created"})], ending="break"))
    async with inproc_gateway(pod_a) as g:
        call = g.stream("/v1/responses", {"model": MODEL, "input": "hi", "stream": True})
        await call.finished()
        assert_openai_error_event(call.chunks[-1], 502)


@pytest.mark.parametrize(
    ("body", "param"),
    [({"model": "nope", "input": "hi"}, "model"), ({"model": MODEL, "input": 3}, "input"),
     ({"model": MODEL, "input": ["x"]}, "input")],
)  # fmt: skip
async def test_responses_answers_the_gateways_errors_in_openais_shape(pod_a, body, param):
    async with inproc_gateway(pod_a) as g:
        r = await g.client.post("/v1/responses", json=body)
        assert_openai_error(r, 404 if param == "model" else 400, param=param)


# -- usage from every API ----------------------------------------------------------


def responses_usage(prompt: int, cached: int) -> dict:
    return {"input_tokens": prompt, "output_tokens": 1, "total_tokens": prompt + 1,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0}}  # fmt: skip


def anthropic_usage(prompt: int, cached: int, created: int = 4) -> dict:
    return {"input_tokens": prompt - cached - created, "output_tokens": 1,
            "cache_creation_input_tokens": created, "cache_read_input_tokens": cached}  # fmt: skip


def event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


USAGE_CASES = {
    "responses-json": ("/v1/responses", False, answer({"usage": responses_usage(100, 64)})),
    "messages-json": ("/v1/messages", False, answer({"usage": anthropic_usage(100, 64)})),
    "responses-stream": ("/v1/responses", True, stream([
        event("response.created", {"response": {"usage": None}}),
        # a long output repeated in the last event pushes its start out of the tail
        event("response.completed", {"response": {"output": [{"text": "x" * 40_000}],
                                                  "usage": responses_usage(100, 64)}}),
    ], delay_s=0.002)),
    "messages-stream": ("/v1/messages", True, stream([
        event("message_start", {"message": {"usage": {"input_tokens": 100, "output_tokens": 0}}}),
        event("content_block_delta", {"delta": {"text": '"usage":{"input_tokens":1}'}}),
        event("message_delta", {"usage": anthropic_usage(100, 64)}),
        event("message_stop", {}),
    ], delay_s=0.002)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(USAGE_CASES))
async def test_usage_of_responses_and_messages_counts_cached_and_computed_tokens(pod_a, case):
    path, streamed, behaviour = USAGE_CASES[case]
    pod_a.script(behaviour)
    body = API_REQUESTS[path]["json"] | {"stream": streamed}
    async with inproc_gateway(pod_a) as g:
        if streamed:
            call = g.stream(path, body)
            await call.finished()
            assert call.status == 200
        else:
            assert (await g.client.post(path, json=body)).status_code == 200
        assert g.metric("kvgate_prompt_tokens_total", pod="pod-a", kind="cached") == 64
        assert g.metric("kvgate_prompt_tokens_total", pod="pod-a", kind="computed") == 36
