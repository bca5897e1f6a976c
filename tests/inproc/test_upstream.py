"""The forwarding client (``gateway.upstream``) against a raw HTTP/1.1 server on loopback.

The server reads and writes bytes itself, so each test scripts exactly what a pod
sends: a keep-alive answer, a chunked stream, a body that ends with the connection,
garbage, a connection closed early, a flood of headers or of body bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from gateway import upstream as upstream_module
from gateway.upstream import (
    READ_HIGH_WATER,
    Upstream,
    UpstreamConnectError,
    UpstreamDropped,
)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
JSON = b'{"ok": true}'


class RawPod:
    """Accepts connections; per request reads the head and body, then runs ``script``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.open_now = 0
        self.most_open = 0
        self.bodies: list[bytes] = []
        self.heads: list[bytes] = []
        self.hung_up = asyncio.Event()  # a client closed a connection mid-exchange
        self.server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> RawPod:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.heads.append(head)
                self.bodies.append(await reader.readexactly(length))
                self.open_now += 1
                self.most_open = max(self.most_open, self.open_now)
                try:
                    await self.script(reader, writer)
                finally:
                    self.open_now -= 1
                if writer.is_closing():
                    return
        except ConnectionError:
            self.hung_up.set()
        finally:
            writer.close()


def answer(body: bytes = JSON, extra: bytes = b"") -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + extra
                     + b"content-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        await writer.drain()

    return script


def answer_after(release: asyncio.Event) -> Script:
    """Holds each request until ``release`` is set, then answers it."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        await answer()(reader, writer)

    return script


@contextlib.asynccontextmanager
async def client(max_connections: int = 16) -> AsyncIterator[Upstream]:
    up = Upstream(max_connections, connect_timeout_s=2.0)
    await up.start()
    try:
        yield up
    finally:
        await up.close()


HEADERS = {"content-type": "application/json", "x-request-id": "r1"}


async def post(up: Upstream, url: str) -> bytes:
    """One exchange's whole body."""
    return await (await up.open(url, b"{}", HEADERS)).read()


async def test_sequential_requests_reuse_one_keep_alive_connection() -> None:
    async with RawPod(answer()) as pod, client() as up:
        for i in range(3):
            resp = await up.open(pod.url, b'{"n": %d}' % i, HEADERS)
            assert resp.status == 200
            assert resp.headers["content-type"] == "application/json"
            assert await resp.read() == JSON
        assert pod.connections == 1
        assert pod.bodies == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
        head = pod.heads[0].decode()
        assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\n")
        assert "x-request-id: r1\r\n" in head and "Content-Length: 8\r\n" in head


async def test_no_more_exchanges_at_once_than_max_connections() -> None:
    release = asyncio.Event()
    async with RawPod(answer_after(release)) as pod, client(max_connections=2) as up:
        tasks = [asyncio.create_task(post(up, pod.url)) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert pod.open_now == 2  # the third waits for a slot
        release.set()
        assert await asyncio.gather(*tasks) == [JSON] * 3
        assert pod.most_open == 2


async def test_a_chunked_stream_arrives_chunk_by_chunk() -> None:
    second = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n6\r\ndata 1\r\n")  # fmt: skip
        await writer.drain()
        await second.wait()
        writer.write(b"6\r\ndata 2\r\n0\r\n\r\n")
        await writer.drain()

    async with RawPod(stream) as pod, client() as up:
        resp = await up.open(pod.url, b"{}", HEADERS)
        chunks = resp.chunks().__aiter__()
        assert await anext(chunks) == b"data 1"  # before the pod sent the rest
        second.set()
        assert [c async for c in chunks] == [b"data 2"]
        resp.release()
        resp = await up.open(pod.url, b"{}", HEADERS)  # the connection was reusable
        second.set()
        assert await resp.read() == b"data 1data 2"
        assert pod.connections == 1


async def test_a_body_that_ends_with_the_connection_is_read_whole_and_not_reused() -> None:
    async def until_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + JSON)
        await writer.drain()
        writer.close()

    async with RawPod(until_eof) as pod, client() as up:
        for _ in range(2):
            resp = await up.open(pod.url, b"{}", HEADERS)
            assert await resp.read() == JSON
        assert pod.connections == 2


async def test_an_informational_response_is_skipped_for_the_answer_after_it() -> None:
    async def hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n")
        await answer()(reader, writer)

    async with RawPod(hints) as pod, client() as up:
        resp = await up.open(pod.url, b"{}", HEADERS)
        assert resp.status == 200 and "link" not in resp.headers
        assert await resp.read() == JSON


@pytest.mark.parametrize(
    "sent",
    [b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n", b"HTTP/1.1 200 OK\r\n"],
    ids=["not-http", "bad-length", "closed-in-head"],
)
async def test_a_broken_answer_before_the_head_is_upstream_dropped(sent: bytes) -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(sent)
        await writer.drain()
        writer.close()

    async with RawPod(broken) as pod, client() as up:
        with pytest.raises(UpstreamDropped):
            await up.open(pod.url, b"{}", HEADERS)
        pod.script = answer()
        resp = await up.open(pod.url, b"{}", HEADERS)  # nothing left behind: a new one works
        assert await resp.read() == JSON


async def test_a_stream_broken_mid_body_delivers_what_came_then_upstream_dropped() -> None:
    async def breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata 1\r\n")
        await writer.drain()
        writer.close()

    async with RawPod(breaks) as pod, client() as up:
        resp = await up.open(pod.url, b"{}", HEADERS)
        got = []
        with pytest.raises(UpstreamDropped):
            async for chunk in resp.chunks():
                got.append(chunk)
        assert got == [b"data 1"]
        resp.close()


async def test_an_unreachable_pod_is_a_connect_error() -> None:
    async with RawPod(answer()) as pod:
        url = pod.url
    async with client() as up:  # the pod's port is closed now
        with pytest.raises(UpstreamConnectError):
            await up.open(url, b"{}", HEADERS)
        with pytest.raises(UpstreamConnectError):
            await up.open("ftp://127.0.0.1:1/x", b"{}", HEADERS)


async def test_headers_beyond_the_bound_are_upstream_dropped() -> None:
    flood = b"".join(b"x-%d: %s\r\n" % (i, b"v" * 1000) for i in range(100))
    async with RawPod(answer(extra=flood)) as pod, client() as up:
        with pytest.raises(UpstreamDropped, match="headers"):
            await up.open(pod.url, b"{}", HEADERS)


@pytest.mark.parametrize("value", ["a\r\nx-evil: 1", "a\nb", "a\rb", "\u20ac"])
async def test_a_header_that_would_forge_another_is_refused_before_sending(value: str) -> None:
    async with RawPod(answer()) as pod, client() as up:
        with pytest.raises(ValueError):
            await up.open(pod.url, b"{}", {**HEADERS, "x-request-id": value})
        assert pod.connections == 0
        resp = await up.open(pod.url, b"{}", HEADERS)  # the slot came back
        assert await resp.read() == JSON


async def test_a_body_read_slowly_stops_being_read_from_the_socket() -> None:
    size = 32 << 20  # more than loopback's socket buffers hold
    done = asyncio.Event()

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()
        done.set()

    async with RawPod(flood) as pod, client() as up:
        resp = await up.open(pod.url, b"{}", HEADERS)
        await asyncio.sleep(0.5)  # the client reads nothing
        assert not done.is_set(), "the pod could send everything: nothing held it back"
        got = 0
        async for chunk in resp.chunks():
            got += len(chunk)
        assert got == size and done.is_set()
        assert READ_HIGH_WATER < size


async def test_a_connection_idle_too_long_is_closed_and_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(upstream_module, "IDLE_CLOSE_S", 0.05)
    monkeypatch.setattr(upstream_module, "SWEEP_EVERY_S", 0.05)
    async with RawPod(answer()) as pod, client() as up:
        resp = await up.open(pod.url, b"{}", HEADERS)
        await resp.read()
        assert up.connections == 1
        await asyncio.sleep(0.3)
        assert up.connections == 0  # the sweeper closed it
        resp = await up.open(pod.url, b"{}", HEADERS)
        await resp.read()
        assert pod.connections == 2


async def test_a_cancelled_exchange_closes_its_connection_so_the_pod_sees_it_end() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the client sends nothing more: this returns at its close
        pod.hung_up.set()

    async with RawPod(silent) as pod, client(max_connections=1) as up:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await up.open(pod.url, b"{}", HEADERS)
        await asyncio.wait_for(pod.hung_up.wait(), 2)
        assert up.connections == 0
        pod.script = answer()
        resp = await up.open(pod.url, b"{}", HEADERS)  # its one slot is free again
        assert await resp.read() == JSON


async def test_closing_an_abandoned_response_closes_the_connection() -> None:
    async with RawPod(answer(body=b"x" * 100)) as pod, client() as up:
        resp = await up.open(pod.url, b"{}", HEADERS)
        resp.close()
        resp.close()  # twice is harmless
        await asyncio.sleep(0.05)
        assert up.connections == 0


async def test_open_connections_never_exceed_the_bound_across_pods() -> None:
    async with RawPod(answer()) as a, RawPod(answer()) as b, RawPod(answer()) as c:
        async with client(max_connections=2) as up:
            for pod in (a, b, c, a):
                resp = await up.open(pod.url, b"{}", HEADERS)
                assert await resp.read() == JSON
                assert up.connections <= 2
                assert up.bounds()["upstream.connections"].size == up.connections
            # c's connection made room by closing a's (the longest idle); a got a new one
            assert (a.connections, b.connections, c.connections) == (2, 1, 1)


async def test_a_pool_of_timed_out_idle_connections_is_closed_at_the_next_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(upstream_module, "SWEEP_EVERY_S", 3600.0)  # no sweep: the request
    release = asyncio.Event()
    async with RawPod(answer_after(release)) as pod, client(max_connections=300) as up:
        tasks = [asyncio.create_task(post(up, pod.url)) for _ in range(300)]
        while pod.open_now < 300:
            await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(*tasks)
        assert up.connections == 300
        monkeypatch.setattr(upstream_module, "IDLE_CLOSE_S", 0.0)
        assert await post(up, pod.url) == JSON  # closes the 300 timed-out ones, opens one
        assert up.connections == 1 and pod.connections == 301


# -- pods that misbehave: a clear error, nothing reused that should not be, nothing lost --


def sends(data: bytes, *, then_close: bool = False, then_wait: bool = False) -> Script:
    """Writes ``data`` as the answer; then closes, or keeps the connection open unused."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        if then_close:
            writer.close()
        elif then_wait:
            await reader.read(1)  # returns once the client closes

    return script


@pytest.mark.parametrize(
    "head",
    [b"HTTP/1.1 200 OK\r\nconnection: close\r\n", b"HTTP/1.0 200 OK\r\n"],
    ids=["connection-close", "http-1.0"],
)
async def test_an_answer_that_ends_the_connection_does_not_return_it_to_the_pool(
    head: bytes,
) -> None:
    sent = head + b"content-length: %d\r\n\r\n%s" % (len(JSON), JSON)
    async with RawPod(sends(sent, then_wait=True)) as pod, client() as up:
        for _ in range(2):
            assert await post(up, pod.url) == JSON
            assert up.connections == 0  # the pod keeps it open; the client closed it
        assert pod.connections == 2


async def test_an_http_1_0_keep_alive_answer_keeps_its_connection() -> None:
    sent = b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: %d\r\n\r\n%s" % (
        len(JSON), JSON)  # fmt: skip
    async with RawPod(sends(sent)) as pod, client() as up:
        for _ in range(2):
            assert await post(up, pod.url) == JSON
        assert pod.connections == 1


@pytest.mark.parametrize(
    "sent",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n10\r\n01234",
    ],
    ids=["short-of-content-length", "mid-chunk"],
)
async def test_a_body_cut_short_is_upstream_dropped_not_a_short_body(sent: bytes) -> None:
    async with RawPod(sends(sent, then_close=True)) as pod, client(max_connections=1) as up:
        resp = await up.open(pod.url, b"{}", HEADERS)
        with pytest.raises(UpstreamDropped, match="closed"):
            await resp.read()
        resp.close()
        assert up.connections == 0
        resp = await up.open(pod.url, b"{}", HEADERS)  # as a stream: what came, then the error
        got = b""
        with pytest.raises(UpstreamDropped):
            async for chunk in resp.chunks():
                got += chunk
        assert got in (b"0123456789", b"01234")
        resp.close()
        pod.script = answer()
        assert await post(up, pod.url) == JSON  # its one slot came back each time


@pytest.mark.parametrize(
    "body",
    [b"zz\r\ndata\r\n0\r\n\r\n", b"5\r\ndata 1\r\n0\r\n\r\n", b"5 x\r\ndata 1\r\n"],
    ids=["not-hex", "longer-than-its-size", "junk-after-size"],
)
async def test_an_invalid_chunk_is_upstream_dropped(body: bytes) -> None:
    sent = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body
    async with RawPod(sends(sent, then_wait=True)) as pod, client(max_connections=1) as up:
        resp = await up.open(pod.url, b"{}", HEADERS)
        with pytest.raises(UpstreamDropped, match="malformed"):
            async with asyncio.timeout(2):
                await resp.read()
        resp.close()
        assert up.connections == 0
        pod.script = answer()
        assert await post(up, pod.url) == JSON


async def test_a_head_that_never_ends_is_refused_at_the_bound() -> None:
    """httptools holds a header line until it ends: the bound is on the bytes read."""

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-flood: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(64):  # 4 MB of one header line, never ended
                writer.write(b"v" * (64 << 10))
                await writer.drain()
            await reader.read(1)

    async with RawPod(endless) as pod, client(max_connections=1) as up:
        with pytest.raises(UpstreamDropped, match="headers"):
            async with asyncio.timeout(5):
                await up.open(pod.url, b"{}", HEADERS)
        assert up.connections == 0


@pytest.mark.parametrize("apart", [False, True], ids=["same-write", "later-write"])
async def test_bytes_after_a_complete_answer_are_not_left_for_the_next_exchange(
    apart: bool,
) -> None:
    first = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfirst"
    stale = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale"

    async def twice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(first if apart else first + stale)
        await writer.drain()
        if apart:
            await asyncio.sleep(0.05)
            writer.write(stale)
            await writer.drain()

    async with RawPod(twice) as pod, client() as up:
        resp = await up.open(pod.url, b"{}", HEADERS)
        assert resp.status == 200 and await resp.read() == b"first"
        await asyncio.sleep(0.1)
        pod.script = answer()
        assert await post(up, pod.url) == JSON  # not the stale answer
        assert pod.connections == 2


async def test_an_early_answer_before_the_body_was_sent_is_its_answer_or_dropped() -> None:
    """The pod answers 413 after the head and closes without reading the body."""
    refusal = b"HTTP/1.1 413 Payload Too Large\r\nconnection: close\r\ncontent-length: 2\r\n\r\nno"

    async def early(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(refusal)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(early, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
    try:
        async with client(max_connections=1) as up:
            for _ in range(3):
                try:
                    async with asyncio.timeout(5):
                        resp = await up.open(url, b"x" * (16 << 20), HEADERS)
                        assert (resp.status, await resp.read()) == (413, b"no")
                except UpstreamDropped:
                    pass  # the pod's reset may discard its answer: a clear error still
                assert up.connections == 0
    finally:
        server.close()


async def test_a_pooled_connection_the_pod_closed_is_replaced_not_failed() -> None:
    """The pod closes a kept-alive connection as the next request goes out on it (its
    idle timeout racing our reuse): nothing of an answer came, so a new one is tried."""
    served_on: dict[asyncio.StreamWriter, int] = {}

    async def once_per_connection(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        served_on[writer] = served_on.get(writer, 0) + 1
        if served_on[writer] > 1:
            writer.close()
            return
        await answer()(reader, writer)

    async with RawPod(once_per_connection) as pod, client() as up:
        assert await post(up, pod.url) == JSON
        assert await post(up, pod.url) == JSON
        assert pod.connections == 2


@pytest.mark.parametrize("status", [100, 103])
async def test_an_informational_answer_then_the_answer_keeps_the_connection(status: int) -> None:
    async def informational(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 %d Whatever\r\n\r\n" % status)
        await answer()(reader, writer)

    async with RawPod(informational) as pod, client() as up:
        for _ in range(2):
            resp = await up.open(pod.url, b"{}", HEADERS)
            assert resp.status == 200 and await resp.read() == JSON
        assert pod.connections == 1


@pytest.mark.parametrize("status", [204, 304])
async def test_an_answer_without_a_body_ends_at_its_head_and_keeps_the_connection(
    status: int,
) -> None:
    sent = b"HTTP/1.1 %d No Body\r\nx-n: 1\r\n\r\n" % status
    async with RawPod(sends(sent)) as pod, client() as up:
        for _ in range(2):
            resp = await up.open(pod.url, b"{}", HEADERS)
            assert resp.status == status
            async with asyncio.timeout(2):
                assert await resp.read() == b""
        assert pod.connections == 1


async def test_cancelled_mid_body_the_closed_response_frees_its_connection_and_slot() -> None:
    async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
        await writer.drain()
        await reader.read(1)  # returns at the client's close
        pod.hung_up.set()

    async with RawPod(half) as pod, client(max_connections=1) as up:
        resp = await up.open(pod.url, b"{}", HEADERS)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await resp.read()
        resp.close()  # what the proxy does in its finally
        await asyncio.wait_for(pod.hung_up.wait(), 2)
        assert up.connections == 0
        pod.script = answer()
        assert await post(up, pod.url) == JSON


async def test_connections_being_opened_at_once_count_against_the_bound() -> None:
    release = asyncio.Event()
    async with RawPod(answer()) as a, RawPod(answer_after(release)) as b:
        async with RawPod(answer_after(release)) as c, client(max_connections=2) as up:
            assert await post(up, a.url) == JSON  # one idle connection to a
            tasks = [asyncio.create_task(post(up, pod.url)) for pod in (b, c)]
            await asyncio.sleep(0.2)
            assert up.connections <= 2
            release.set()
            assert await asyncio.gather(*tasks) == [JSON] * 2
            assert up.connections <= 2
