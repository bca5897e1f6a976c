"""A pod that does not answer in time: the client gets a 504 in the OpenAI shape.

The first-byte timeout bounds the wait for the pod's first byte; the total timeout
bounds the whole exchange. (Whether timeouts count toward ejection is not asserted
here.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.inproc.harness import CHAT, STREAM_CHAT, inproc_gateway
from tests.inproc.scripted_pod import MODEL, answer, completion, hang, stream
from tests.openai_errors import assert_openai_error


@pytest.mark.parametrize(
    ("body", "silence"),
    [(STREAM_CHAT, hang()), (STREAM_CHAT, stream([], ending="hold"))],
    ids=["stream-no-head", "stream-head-but-no-first-byte"],
)
async def test_pod_that_never_answers_is_504_after_the_first_byte_timeout(pod_a, body, silence):
    pod_a.script(silence)
    async with inproc_gateway(pod_a, timeouts={"first_byte_s": 0.2}) as g:
        started = time.perf_counter()
        r = await g.chat(body)
        waited = time.perf_counter() - started
        err = assert_openai_error(r, 504)
        assert err["type"] == "timeout_error"
        assert 0.2 <= waited < 1.0  # the first-byte timeout, far below the total (5 s)
        assert r.headers["x-request-id"]
        assert g.metric("kvgate_requests_total", model=MODEL, status="504") == 1
        await asyncio.wait_for(pod_a.received[0].gone.wait(), 1.0)  # upstream closed


async def test_a_non_streamed_answer_is_waited_for_until_the_total_deadline(pod_a):
    """vLLM sends a non-streamed answer whole once generated: its first byte is its
    last. A generation longer than first_byte_s is answered; a pod silent past total_s
    is a 504."""
    pod_a.script(hang())
    async with inproc_gateway(pod_a, timeouts={"first_byte_s": 0.2, "total_s": 0.6}) as g:
        started = time.perf_counter()
        r = await g.chat(CHAT)
        waited = time.perf_counter() - started
        assert_openai_error(r, 504)
        assert 0.6 <= waited < 1.5  # the total deadline, not the first-byte one
    generated = asyncio.Event()
    pod_a.script(hang(generated, then=answer(completion())))
    async with inproc_gateway(pod_a, timeouts={"first_byte_s": 0.2, "total_s": 5.0}) as g:
        asyncio.get_running_loop().call_later(0.5, generated.set)
        r = await g.chat(CHAT)
        assert r.status_code == 200, r.text
        assert g.failures("pod-a") == 0


async def test_body_slower_than_the_total_timeout_is_504(pod_a):
    pod_a.script(stream([b'{"id": "chatcmpl-'], ending="hold"))  # head, a first byte, then stall
    async with inproc_gateway(pod_a, timeouts={"first_byte_s": 0.3, "total_s": 0.3}) as g:
        started = time.perf_counter()
        r = await g.chat(CHAT)
        waited = time.perf_counter() - started
        err = assert_openai_error(r, 504)
        assert err["type"] == "timeout_error"
        assert 0.3 <= waited < 1.0  # the total deadline, from arrival
        await asyncio.wait_for(pod_a.received[0].gone.wait(), 1.0)
