"""``stream_headers_early``: a stream's status and headers reach the client as soon as the
pod's do, before its first body byte; from then on a failure is one SSE error event on
that pod's stream, never a retry elsewhere."""

from __future__ import annotations

import asyncio

from bench.polling import wait_for_async
from tests.inproc.harness import inproc_gateway
from tests.inproc.scripted_pod import MODEL, delta, sse, stream
from tests.openai_errors import assert_openai_error_event

PIECES = [sse(delta("Hel")), sse(delta("lo"))]


async def test_the_headers_come_before_the_first_byte_and_the_stream_is_relayed_unchanged(pod_a):
    release = asyncio.Event()
    pod_a.script(stream(PIECES, ending="complete", before_first=release))
    async with inproc_gateway(pod_a, stream_headers_early=True) as g:
        call = g.stream_chat()
        await wait_for_async(lambda: call.status is not None, 2.0, "the response to start")
        assert (call.status, call.headers["x-kvgate-pod"], call.chunks) == (200, "pod-a", [])
        release.set()  # the pod's first token
        await call.finished()
        assert call.body.startswith(b"".join(PIECES)) and call.complete
        assert g.metric("kvgate_requests_total", pod="pod-a", status="200") == 1


async def test_without_it_the_response_starts_with_the_first_byte(pod_a):
    release = asyncio.Event()
    pod_a.script(stream(PIECES, ending="complete", before_first=release))
    async with inproc_gateway(pod_a) as g:
        call = g.stream_chat()
        await wait_for_async(lambda: len(pod_a.received) == 1, 2.0, "the pod to be asked")
        await asyncio.sleep(0.05)
        assert call.status is None  # held back: a failure now could still be retried
        release.set()
        await call.finished()
        assert call.status == 200 and call.body.startswith(b"".join(PIECES))


async def test_a_pod_dropping_before_its_first_byte_is_an_sse_error_not_a_retry(pod_a, pod_b):
    pod_a.script(stream([], ending="break"))  # head, then the connection closes
    async with inproc_gateway(pod_a, pod_b, stream_headers_early=True) as g:
        call = g.stream_chat()
        await call.finished()
        assert (call.status, call.headers["x-kvgate-pod"], call.complete) == (200, "pod-a", True)
        err = assert_openai_error_event(call.body, 502)
        assert "'pod-a' failed" in err["message"]
        assert pod_b.received == [] and g.metric("kvgate_retries_total") == 0
        assert g.failures("pod-a") == 1
        assert g.metric("kvgate_requests_total", model=MODEL, status="502") == 1
        assert g.load("pod-a") == 0


async def test_no_first_byte_in_time_is_a_504_sse_error_and_the_pod_sees_us_leave(pod_a):
    pod_a.script(stream([], ending="hold"))
    async with inproc_gateway(pod_a, stream_headers_early=True,
                              timeouts={"first_byte_s": 0.2}) as g:  # fmt: skip
        call = g.stream_chat()
        await call.finished()
        err = assert_openai_error_event(call.body, 504)
        assert err["type"] == "timeout_error" and "no first byte" in err["message"]
        assert g.metric("kvgate_requests_total", model=MODEL, status="504") == 1
        await asyncio.wait_for(pod_a.received[0].gone.wait(), 1.0)
