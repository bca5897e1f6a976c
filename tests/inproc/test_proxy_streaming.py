"""Streams after the first byte: relayed as they come, failures as one SSE error event,
a client leaving releases everything, and the usage in the tail is counted."""

from __future__ import annotations

import asyncio
from itertools import pairwise

import pytest

from bench.polling import wait_for_async
from gateway import accounting
from tests.inproc.harness import inproc_gateway
from tests.inproc.scripted_pod import MODEL, SSE_DONE, answer, completion, delta, sse, stream
from tests.openai_errors import assert_openai_error_event

PIECES = [sse(delta("Hel")), sse(delta("lo")), sse(delta(" there"))]


def usage_chunk(prompt_tokens: int, cached_tokens: int) -> bytes:
    """vLLM's last chunk with ``stream_options.include_usage``: no choices, the usage."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
             "total_tokens": prompt_tokens + 3,
             "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip
    return sse({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "choices": [],
                "usage": usage})  # fmt: skip


def after(body: bytes, relayed: bytes) -> bytes:
    """The rest of ``body``, which must start with ``relayed``: unchanged, in order."""
    assert body[: len(relayed)] == relayed
    return body[len(relayed) :]


async def test_pod_failure_after_first_byte_becomes_one_sse_error_event(pod_a, pod_b):
    pod_a.script(stream(PIECES, delay_s=0.005, ending="break"))
    async with inproc_gateway(pod_a, pod_b) as g:
        call = g.stream_chat()
        await call.finished()
        assert (call.status, call.headers["x-kvgate-pod"], call.complete) == (200, "pod-a", True)
        err = assert_openai_error_event(after(call.body, b"".join(PIECES)), 502)
        assert err["type"] == "upstream_error" and "mid-stream" in err["message"]
        assert pod_b.received == []  # no retry once the client has bytes
        assert g.metric("kvgate_retries_total") == 0
        assert g.failures("pod-a") == 1
        assert g.metric("kvgate_requests_total", pod="pod-a", status="502") == 1
        assert g.load("pod-a") == 0


async def test_total_timeout_mid_stream_becomes_one_504_sse_error_event(pod_a):
    pod_a.script(stream(PIECES[:1], ending="hold"))
    async with inproc_gateway(pod_a, timeouts={"first_byte_s": 0.3, "total_s": 0.3}) as g:
        call = g.stream_chat()
        await call.finished()
        err = assert_openai_error_event(after(call.body, PIECES[0]), 504)
        assert err["type"] == "timeout_error"
        await asyncio.wait_for(pod_a.received[0].gone.wait(), 1.0)


async def test_client_leaving_mid_stream_is_499_releases_load_and_closes_upstream(pod_a):
    pod_a.script(stream(PIECES[:1], ending="hold"))
    async with inproc_gateway(pod_a) as g:
        call = g.stream_chat()
        await call.received(1)
        assert call.chunks == PIECES[:1]
        assert (g.load("pod-a"), g.metric("kvgate_pod_in_flight_requests", pod="pod-a")) == (1, 1)
        call.leave()
        await call.finished()
        assert g.metric("kvgate_requests_total", pod="pod-a", status="499") == 1
        assert (g.load("pod-a"), g.metric("kvgate_pod_in_flight_requests", pod="pod-a")) == (0, 0)
        await asyncio.wait_for(pod_a.received[0].gone.wait(), 1.0)
        assert g.failures("pod-a") == 0  # not the pod's fault


def split(data: bytes, *at: int) -> list[bytes]:
    """``data`` cut at the offsets ``at``: each piece is written on its own."""
    return [data[i:j] for i, j in pairwise([0, *at, len(data)])]


@pytest.mark.parametrize(
    "tail",
    [[usage_chunk(100, 64), SSE_DONE], [*split(usage_chunk(100, 64), 3, 40, 90), SSE_DONE]],
    ids=["usage-in-one-write", "usage-split-across-four-writes"],
)
async def test_usage_in_the_last_sse_chunk_counts_cached_and_computed_tokens(pod_a, tail):
    pieces = [*PIECES, *tail]
    pod_a.script(stream(pieces, delay_s=0.005))
    async with inproc_gateway(pod_a) as g:
        call = g.stream_chat()
        await call.finished()
        assert call.body == b"".join(pieces)
        assert g.metric("kvgate_prompt_tokens_total", pod="pod-a", kind="cached") == 64
        assert g.metric("kvgate_prompt_tokens_total", pod="pod-a", kind="computed") == 36
        assert g.metric("kvgate_requests_total", pod="pod-a", status="200") == 1


async def test_usage_in_a_json_body_counts_cached_and_computed_tokens(pod_a):
    pod_a.script(answer(completion(prompt_tokens=100, cached_tokens=64)))
    async with inproc_gateway(pod_a) as g:
        assert (await g.chat()).status_code == 200
        assert g.metric("kvgate_prompt_tokens_total", pod="pod-a", kind="cached") == 64
        assert g.metric("kvgate_prompt_tokens_total", pod="pod-a", kind="computed") == 36


@pytest.mark.parametrize(
    ("prompt", "cached"),
    [(10, 20), (10, -1), (-10, 0), (2**40, 0)],
    ids=["cached-over-prompt", "negative-cached", "negative-prompt", "huge-prompt"],
)
async def test_usage_a_pod_got_wrong_loses_the_client_nothing(pod_a, prompt, cached):
    pod_a.script(answer(completion(prompt_tokens=prompt, cached_tokens=cached)),
                 stream([*PIECES, usage_chunk(prompt, cached), SSE_DONE]))  # fmt: skip
    async with inproc_gateway(pod_a) as g:
        whole = await g.chat()
        assert whole.status_code == 200
        assert whole.json()["usage"]["prompt_tokens"] == prompt  # the pod's body, as sent
        call = g.stream_chat()
        await call.finished()
        assert call.body.endswith(SSE_DONE)  # the stream's end reached the client
        assert g.metric("kvgate_requests_total", pod="pod-a", status="200") == 2
        counted = g.metric("kvgate_prompt_tokens_total", pod="pod-a", kind="computed")
        assert counted == (prompt if 0 <= prompt < 2**31 else 0) * 2  # cached left out


def test_a_tail_of_usage_keys_is_parsed_a_bounded_number_of_times(monkeypatch):
    attempts = []
    real = accounting._json_decoder.raw_decode

    def counted(text: str, idx: int = 0):  # type: ignore[no-untyped-def]
        attempts.append(idx)
        return real(text, idx)

    monkeypatch.setattr(accounting._json_decoder, "raw_decode", counted)
    tail = b'"usage":{' * 4000  # a pod's garbage: every key opens an object never closed
    assert accounting.usage_from_sse(tail) is None
    assert len(attempts) <= 8


async def test_kv_aware_learns_a_streams_ttft_at_its_first_token_not_at_its_end(pod_a):
    # The stream stays open after its first chunk: kv-aware has the TTFT already, and
    # the stream's end (the client leaving here) teaches it nothing more.
    pod_a.script(stream(PIECES[:1], ending="hold"))
    body = {"model": MODEL, "prompt": list(range(3000)), "max_tokens": 5, "stream": True}
    async with inproc_gateway(pod_a, strategy="kv-aware") as g:
        calibrator = g.gw.router.core.strategy_for(MODEL).calibrator(MODEL)
        call = g.stream("/v1/completions", body)
        await call.received(1)
        await wait_for_async(lambda: calibrator.samples == 1, 1.0, "the first token learnt")
        assert calibrator.last_point is not None and calibrator.last_point[0] == 3000
        call.leave()
        await call.finished()
        assert g.load("pod-a") == 0
        assert calibrator.samples == 1


async def test_kv_aware_revises_a_first_token_point_the_pods_usage_contradicts(pod_a):
    # The first request's blocks are speculated onto pod-a, so the second is predicted a
    # cache hit; the pod's usage then says nothing was cached (an eviction the index had
    # not heard of). The point learnt at the second's first token put a whole prefill's
    # TTFT on a few uncached tokens: at the end it is replaced by the engine's count.
    ends = [*PIECES, usage_chunk(3000, 0), SSE_DONE]
    pod_a.script(stream(ends), stream(ends))
    body = {"model": MODEL, "prompt": list(range(3000)), "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with inproc_gateway(pod_a, strategy="kv-aware") as g:
        calibrator = g.gw.router.core.strategy_for(MODEL).calibrator(MODEL)
        first = g.stream("/v1/completions", body)
        await first.finished()
        second = g.stream("/v1/completions", body)
        await second.finished()
        # The index expected a hit: the predicted cached count is off by the prefix.
        assert g.metric("kvgate_predicted_cached_tokens_abs_error_sum") >= 2048
        await wait_for_async(lambda: calibrator.samples == 2, 1.0, "both requests learnt")
        assert calibrator.last_point is not None and calibrator.last_point[0] == 3000
        assert calibrator.samples == 2  # replaced, not added beside
