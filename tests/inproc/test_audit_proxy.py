"""The forwarding path against pods and clients that misbehave on the wire: every
request still ends, in time, with a clear answer, and the counts return to 0.

The pipelining test needs the real server side (uvicorn with the gateway's guarded
protocol, in the test's event loop): ASGI alone cannot pipeline two requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator

import pytest
import uvicorn

from gateway.server import uvicorn_config
from gateway.upstream import MAX_HEAD_BYTES, Upstream, UpstreamDropped
from tests.inproc.harness import CHAT, STREAM_CHAT, InprocGateway, inproc_gateway
from tests.inproc.scripted_pod import Received, Wire, delta, sse, stream
from tests.inproc.test_upstream import HEADERS, RawPod


def raw(data: bytes, *, then_hold: bool = False):  # noqa: ANN201 (a Behaviour)
    """A pod behaviour that writes ``data`` as its answer, then holds the connection."""

    async def respond(wire: Wire, received: Received) -> None:
        await wire.write(data)
        if then_hold:
            await wire.hold(received, None)

    return respond


@contextlib.asynccontextmanager
async def upstream_to(handler) -> AsyncIterator[tuple[Upstream, str]]:  # noqa: ANN001
    """A started forwarding client of one connection, and a raw pod running ``handler``."""
    async with RawPod(handler) as pod:
        up = Upstream(1, 2.0)
        await up.start()
        try:
            yield up, pod.url
        finally:
            await up.close()


def settled(g: InprocGateway, pod: str) -> None:
    """Nothing of a finished request is still counted."""
    assert g.load(pod) == 0
    assert g.metric("kvgate_pod_in_flight_requests", pod=pod) == 0
    assert (g.gw.in_flight.requests, g.gw.in_flight.body_bytes) == (0, 0)


# -- a 5xx whose body never ends is still answered in time, and retried --


async def test_a_5xx_whose_body_stalls_is_retried_at_once(pod_a, pod_b):
    """The pod's 500 head arrives, the rest of its body never does: the request must not
    wait for it (it had no deadline at all), and it is retried on the other pod within
    its first-byte deadline (2 s)."""
    pod_a.script(raw(b"HTTP/1.1 500 Oops\r\ncontent-length: 100\r\n\r\npartial", then_hold=True))
    async with inproc_gateway(pod_a, pod_b) as g:
        started = time.monotonic()
        async with asyncio.timeout(4):
            r = await g.chat()
        assert (r.status_code, r.headers["x-kvgate-pod"]) == (200, "pod-b")
        assert time.monotonic() - started < 1.5
        await asyncio.wait_for(pod_a.received[0].gone.wait(), 2)  # its connection closed
        settled(g, "pod-a")
        assert g.gw.upstream.connections == 1  # pod-b's, idle


async def test_a_5xx_body_is_read_no_further_than_the_error_message_needs(pod_a, pod_b):
    """A 500 with an endless body is not read to its end to quote 500 bytes of it."""

    async def endless(wire: Wire, received: Received) -> None:
        await wire.write(b"HTTP/1.1 500 Oops\r\ntransfer-encoding: chunked\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            while True:
                await wire.chunk(b"e" * (64 << 10))
                await asyncio.sleep(0.01)

    pod_a.script(endless)
    async with inproc_gateway(pod_a, pod_b, retry={"max_attempts": 1}) as g:
        async with asyncio.timeout(4):
            r = await g.chat()
        assert r.status_code == 502 and "returned 500: eeee" in r.json()["error"]["message"]
        settled(g, "pod-a")
        assert g.gw.upstream.connections == 0  # not reused: its body was not read


async def test_a_body_framed_by_transfer_encoding_identity_ends_at_the_close(pod_a, pod_b):
    """Neither a length nor chunked last: the body ends when the pod closes (RFC 9112
    6.3), a whole answer, not a dropped one to retry on the other pod."""
    body = json.dumps({"id": "cmpl-identity", "object": "chat.completion", "choices": []})

    async def identity(wire: Wire, received: Received) -> None:
        await wire.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"transfer-encoding: identity\r\n\r\n" + body.encode())  # fmt: skip
        wire.drop()

    pod_a.script(identity)
    async with inproc_gateway(pod_a, pod_b) as g:
        r = await g.chat()
        assert (r.status_code, r.headers["x-kvgate-pod"]) == (200, "pod-a")
        assert r.json()["id"] == "cmpl-identity"
        settled(g, "pod-a")


# -- a status line no HTTP server sends is a malformed answer, not a crash --


@pytest.mark.parametrize("status", [b"000", b"099", b"600", b"999"])
async def test_a_status_outside_100_to_599_is_a_malformed_answer(status: bytes) -> None:
    sent = b"HTTP/1.1 %s Odd\r\ncontent-length: 2\r\n\r\n{}" % status

    async def odd(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(sent)
        await writer.drain()
        await reader.read(1)

    async with upstream_to(odd) as (up, url):
        with pytest.raises(UpstreamDropped, match="status"):
            await up.open(url, b"{}", HEADERS)
        assert up.connections == 0


async def test_a_pod_answering_status_99_gets_the_client_a_502_through_uvicorn(pod_a, pod_b):
    """uvicorn has no status line for 99: the client got its connection closed, no answer."""
    pod_a.script(raw(b"HTTP/1.1 099 Odd\r\ncontent-type: application/json\r\n"
                     b"content-length: 2\r\n\r\n{}"))  # fmt: skip
    async with inproc_gateway(pod_a, pod_b, retry={"max_attempts": 1}) as g, served(g) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post_bytes(CHAT))
        async with asyncio.timeout(3):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 502 ")
        writer.close()
        settled(g, "pod-a")


# -- trailers are bounded like headers --


async def test_a_trailer_line_that_never_ends_is_refused_at_the_head_bound() -> None:
    """httptools holds a header line until it ends, trailers too: 256 MB of one trailer
    line was held whole (and copied again for each read: minutes of the event loop)."""

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nx-t: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(4096):
                writer.write(b"v" * (64 << 10))
                await writer.drain()
            await reader.read(1)

    async with upstream_to(endless) as (up, url):
        resp = await up.open(url, b"{}", HEADERS)
        got = b""
        with pytest.raises(UpstreamDropped, match="headers"):
            async with asyncio.timeout(5):
                async for chunk in resp.chunks():
                    got += chunk
        assert got == b"{}"
        resp.close()
        assert up.connections == 0


async def test_a_long_stream_of_small_chunks_is_not_taken_for_a_flood_of_trailers() -> None:
    """Chunk framing between body bytes is not counted against the head bound."""
    pieces = [b"x" * 10] * (4 * MAX_HEAD_BYTES // 10)
    framed = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\nx-t: 1\r\n\r\n"

    async def chunky(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(0, len(framed), 4096):
            writer.write(framed[i : i + 4096])
            await writer.drain()

    async with upstream_to(chunky) as (up, url):
        resp = await up.open(url, b"{}", HEADERS)
        assert await resp.read() == b"".join(pieces)


# -- a client pipelining requests still cancels the one being answered when it leaves --


@contextlib.asynccontextmanager
async def served(g: InprocGateway) -> AsyncIterator[int]:
    """The gateway's serving app behind uvicorn and the guarded protocol, as ``kvgate
    serve`` runs it, on a loopback port (the lifespan is ``g``'s)."""
    config = uvicorn_config(g.gw.settings, g.app)
    config.lifespan, config.loop = "off", "asyncio"
    server = uvicorn.Server(config)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 5)


def post_bytes(body: dict, path: str = "/v1/chat/completions") -> bytes:
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nhost: kvgate\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data))  # fmt: skip


async def test_a_client_that_pipelined_and_left_cancels_the_request_being_answered(pod_a):
    """uvicorn tells only the newest request on a connection that its client left; the
    one being answered, with another pipelined behind it, went on to the pod's end."""
    pod_a.script(stream([sse(delta("a"))], ending="hold"))
    async with inproc_gateway(pod_a) as g, served(g) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post_bytes(STREAM_CHAT) + post_bytes(CHAT))
        async with asyncio.timeout(3):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
            await reader.readuntil(b"data: ")  # the stream is being relayed
        writer.close()
        await asyncio.wait_for(pod_a.received[0].gone.wait(), 2)
        await asyncio.sleep(0.05)  # the handler's clean-up
        settled(g, "pod-a")
        assert len(pod_a.received) == 1  # the pipelined request was never sent


async def test_pipelined_requests_are_answered_in_order(pod_a):
    async with inproc_gateway(pod_a) as g, served(g) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post_bytes(CHAT) * 3)
        async with asyncio.timeout(3):
            for _ in range(3):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 ")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                assert json.loads(await reader.readexactly(length))["object"] == "chat.completion"
        writer.close()
        settled(g, "pod-a")


# -- a pod that goes quiet mid-stream ends the stream, not only total_s --


async def test_a_stream_whose_pod_goes_quiet_ends_after_stream_idle_s(pod_a):
    """The first token came, then nothing: the client gets one SSE error after
    ``timeouts.stream_idle_s`` (not ``total_s``, 900 s by default), and the pod a failure."""
    pod_a.script(stream([sse(delta("a"))], ending="hold"))
    timeouts = {"total_s": 30.0, "stream_idle_s": 0.3}
    async with inproc_gateway(pod_a, timeouts=timeouts) as g:
        started = time.monotonic()
        call = g.stream_chat()
        await call.finished(timeout=3.0)
        assert 0.3 <= time.monotonic() - started < 2.0
        assert call.status == 200 and call.complete
        assert b"sent nothing for 0.3 s mid-stream" in call.chunks[-1]
        assert g.failures("pod-a") == 1
        settled(g, "pod-a")


async def test_a_slow_steady_stream_is_not_taken_for_a_quiet_pod(pod_a):
    """Chunks 0.1 s apart for over three times the idle limit: the whole stream passes."""
    pieces = [sse(delta(str(i))) for i in range(12)] + [b"data: [DONE]\n\n"]
    pod_a.script(stream(pieces, delay_s=0.1))
    async with inproc_gateway(pod_a, timeouts={"stream_idle_s": 0.3}) as g:
        call = g.stream_chat()
        await call.finished(timeout=4.0)
        assert call.body.endswith(b"data: [DONE]\n\n") and b"error" not in call.body
        assert g.failures("pod-a") == 0
        settled(g, "pod-a")
