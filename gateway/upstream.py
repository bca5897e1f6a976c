"""The forwarding client: one seam between the proxy and the HTTP/1.1 connections to pods.

What it does is narrow: POST a body that is already in memory to a pod, hand back the
status and headers once they arrive, then the body whole or as it arrives; keep the
connection for the next request. So it is a small ``asyncio.Protocol`` over
``httptools`` (the C parser uvicorn uses on the client side of the gateway) with a
keep-alive pool, not a general HTTP library. Why not one: per request aiohttp's
client spent 114-130 µs of CPU against a zero-latency pod and this one 35-37
(``python -m bench.upstream_cpu``; docs/performance.md, "A forwarding client of its
own"), and aiohttp was the largest single share of a proxied request's CPU. httpx
stays for health probes, admin and engine ``/tokenize`` calls, which are not on the
hot path.

The proxy sees only ``Upstream.open`` and ``UpstreamResponse``, and three failures:
``UpstreamConnectError`` (the pod could not be reached: retry elsewhere),
``UpstreamDropped`` (it closed or broke the connection, or sent something that is
not an HTTP/1.1 response: retry before the first byte, an SSE error after), and
``TimeoutError`` from the deadlines the proxy wraps around each call. A call that is
cancelled or times out mid-exchange closes its connection, so the pod sees the
request end (vLLM then aborts it). A kept-alive connection the pod closes as a request
goes out on it, before a byte of an answer, is not a failure: the request goes again on
a new connection, once. A connection that carried anything but one whole answer
(``Connection: close``, a body cut short, bytes after the answer) is never reused.

Bounded: at most ``max_connections`` exchanges at once (a semaphore; more wait for a
slot) and as many connections open, busy or idle (a new one closes the longest idle
one when needed; idle ones are closed after ``IDLE_CLOSE_S``), a response's headers at
most ``MAX_HEAD_BYTES``, and a response body read more slowly than the pod sends it
buffers at most about ``READ_HIGH_WATER`` before the socket stops being read (TCP
then slows the pod).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast
from urllib.parse import quote, unquote, urlsplit

import httptools

from kvindex.types import Bound

# Idle pooled connections are not reused after this. vLLM's server (uvicorn) closes idle
# keep-alive connections after 5 s; not reusing ours past 4 keeps a request from being
# sent on a connection the pod is closing at that moment, which would look like a fault.
IDLE_CLOSE_S = 4.0
SWEEP_EVERY_S = 1.0  # how often idle connections past IDLE_CLOSE_S are closed
MAX_HEAD_BYTES = 64 << 10  # a response's header names and values together
READ_HIGH_WATER = 256 << 10  # body bytes buffered unread before reading pauses
READ_LOW_WATER = 64 << 10  # ... and resumes
# A connection's objects here and in uvloop (tracemalloc, CPython 3.11), not the
# kernel's socket buffers.
CONNECTION_BYTES = 2_400
_MAX_TARGETS = 1024  # parsed URLs remembered (pods x API paths)
_SAFE_PATH = "/:@!$&'()*+,;=-._~"  # what a request target keeps as it is


class UpstreamError(Exception):
    """The pod did not complete the exchange."""


class UpstreamConnectError(UpstreamError):
    """The pod could not be reached (refused, unresolvable, connect timeout)."""


class UpstreamDropped(UpstreamError):
    """The pod closed or broke the connection, or sent a malformed response."""


class _Target:
    """A pod URL parsed once: its pool key and the first lines of a request to it."""

    __slots__ = ("origin", "start")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamConnectError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if scheme == "https" else 80)
        self.origin = (scheme, parts.hostname, port)
        host = parts.netloc.rpartition("@")[2]
        path = quote(parts.path or "/", safe=_SAFE_PATH + "%")
        if parts.query:
            path += "?" + parts.query
        start = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
        if parts.username is not None:  # credentials in the pod's URL: Basic auth
            user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            start += f"Authorization: Basic {base64.b64encode(user.encode()).decode()}\r\n"
        self.start = start


def request_head(start: str, headers: Mapping[str, str], length: int) -> bytes:
    """The request's head: ``start`` (request and Host lines), ``headers``, the length.

    A CR or LF in a header would start a header or a request of someone else's making:
    refused (``ValueError``), as is a character beyond Latin-1."""
    text = start + "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
    text += f"Content-Length: {length}\r\n\r\n"
    lines = start.count("\n") + len(headers) + 2
    if text.count("\n") != lines or text.count("\r") != lines:
        raise ValueError("a request header contains CR or LF")
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError("a request header is not Latin-1") from None


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a pod, one exchange at a time."""

    def __init__(self, pool: Upstream, origin: tuple[str, str, int]) -> None:
        self._pool = pool
        self.origin = origin
        self.idle_since = 0.0
        self.closed = False
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None  # None: between exchanges
        self._head: asyncio.Future[None] | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self._head_bytes = 0
        # Bytes read in a row that carried no body byte: a head, or trailers after a
        # chunked body (httptools holds each of their lines whole until it ends).
        self._bodiless = 0
        self._heard = False  # a byte of this exchange's answer arrived
        self._refused: str | None = None  # why a callback stopped the parser
        self._informational = False  # a 1xx response precedes the real one
        self._until_eof = False  # neither Content-Length nor chunked: the body ends at EOF
        self.keep_alive = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self.complete = False
        self._error: UpstreamDropped | None = None
        self._waiter: asyncio.Future[None] | None = None  # a reader waiting for body bytes

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's does not subclass it

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self.complete:
            self._fail("sent bytes outside an exchange")
            return
        self._heard = True
        buffered = self._buffered
        try:
            self._parser.feed_data(data)
        except Exception as exc:  # HttpParserError, an upgrade we never asked for
            self._fail(self._refused or f"sent a malformed response ({exc!r})")
            return
        if self._buffered == buffered:  # not a body byte in it
            # httptools holds a header line until it ends, so on_header cannot bound a
            # head, or trailers after the last chunk, that never do: the bytes read in a
            # row without a body byte are bounded too (chunk framing between body bytes
            # is not counted: each read of a body resets the count).
            self._bodiless += len(data)
            if self._bodiless > MAX_HEAD_BYTES:
                self._fail(f"sent more than {MAX_HEAD_BYTES} bytes of headers")
        else:
            self._bodiless = 0

    def eof_received(self) -> bool:
        return False  # the transport closes itself; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._parser is not None and not self.complete and self._error is None:
            if exc is None and self._until_eof and self._head is not None and self._head.done():
                self.on_message_complete()  # the body that ends with the connection did
            else:
                self._fail("closed the connection" if exc is None else f"broke: {exc!r}")
        self._pool._lost(self)

    # -- httptools callbacks --

    def on_message_begin(self) -> None:
        if self.complete:  # in the read that ended the answer: a second answer follows it
            self._refused = "sent more than one answer"  # the connection goes, the first stays
            raise UpstreamDropped(self._refused)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:  # the parser reports it as its own error
            self._refused = f"sent more than {MAX_HEAD_BYTES} bytes of headers"
            raise UpstreamDropped(self._refused)
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        old = self.headers.get(key)
        self.headers[key] = text if old is None else f"{old}, {text}"

    def on_headers_complete(self) -> None:
        assert self._parser is not None and self._head is not None
        status = self._parser.get_status_code()
        if not 100 <= status < 600:
            # httptools takes any 3 digits; the gateway's server (uvicorn) has no status
            # line for one outside 100-599 and would drop the client without an answer.
            self._refused = f"sent status {status}"
            raise UpstreamDropped(self._refused)
        if status < 200:  # informational (103 Early Hints, ...): the answer follows
            self._informational = True
            return
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        # A response's body ends at the connection's close unless it has a length or
        # is chunked last (RFC 9112 6.3: ``Transfer-Encoding: identity`` alone too).
        coding = self.headers.get("transfer-encoding", "").rstrip().lower()
        self._until_eof = (
            "content-length" not in self.headers
            and not coding.endswith("chunked")
            and status not in (204, 304)
        )
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > READ_HIGH_WATER and not self._paused and self._transport:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            self.headers = {}
            self._head_bytes = 0
            self._bodiless = 0
            return
        self.complete = True
        self._wake()

    # -- the exchange --

    def send(self, data: bytes) -> asyncio.Future[None]:
        """Start an exchange: write the request; the future is done when the head is in."""
        assert self._transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._head = self._pool.loop.create_future()
        self._bodiless = 0
        self._heard = False
        self._transport.write(data)
        return self._head

    async def read_chunk(self) -> bytes:
        """The next body bytes, b"" at the end."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered <= READ_LOW_WATER and self._transport:
                    self._paused = False
                    self._transport.resume_reading()
                return chunk
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._pool.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read_all(self) -> bytes:
        chunks = []
        while chunk := await self.read_chunk():
            chunks.append(chunk)
        return b"".join(chunks)

    def reset(self) -> None:
        """Between exchanges (the last one complete; what was not read of it is dropped)."""
        self._parser = None
        self._head = None
        self.headers = {}
        self._head_bytes = 0
        self.complete = False
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    @property
    def closed_unheard(self) -> bool:
        """Closed with not a byte of an answer: on a reused connection, the pod closing
        it as idle (its keep-alive timeout, a restart) as our request went out."""
        return self.closed and not self._heard

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()
        self._pool._lost(self)  # at once: it no longer counts against the bound

    def _fail(self, what: str) -> None:
        self._error = UpstreamDropped(f"the pod {what}")
        if self._head is not None and not self._head.done():
            self._head.set_exception(self._error)
        self._wake()
        self.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class UpstreamResponse:
    """A pod's answer once its status line and headers arrived; the body is read on demand.

    ``headers``: names lower-cased, repeated headers joined with ", "."""

    __slots__ = ("_pool", "_conn", "status", "headers")

    def __init__(self, pool: Upstream, conn: _Connection) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.headers: Mapping[str, str] = conn.headers

    async def read(self) -> bytes:
        """The whole body; the connection then goes back to the pool."""
        conn = self._conn
        if conn is None:
            raise UpstreamDropped("the response was already released")
        body = await conn.read_all()
        self.release()
        return body

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (not re-framed: SSE events pass through as sent)."""
        conn = self._conn
        if conn is None:
            return
        while chunk := await conn.read_chunk():
            yield chunk

    def release(self) -> None:
        """Done with the exchange: a connection whose response was read to its end goes
        back to the pool, any other is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._release(conn, reuse=True)

    def close(self) -> None:
        """Abandon the exchange: the connection is closed, so the pod sees the request end.
        (A no-op after ``release``.)"""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._release(conn, reuse=False)


class Upstream:
    """A pooled HTTP/1.1 client for the pods (keep-alive, bounded connections)."""

    def __init__(self, max_connections: int, connect_timeout_s: float) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self._max_connections = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._slots: asyncio.Semaphore | None = None
        # per pod, its idle connections oldest first (a dict: O(1) removal from the middle)
        self._idle: dict[tuple[str, str, int], dict[_Connection, None]] = {}
        self._open: set[_Connection] = set()
        self._connecting = 0  # connections being made: they count against the bound too
        self._targets: dict[str, _Target] = {}
        self._ssl: ssl.SSLContext | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.loop: asyncio.AbstractEventLoop  # the running loop, from start()

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(self._max_connections)
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="kvgate-upstream-idle")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports finish closing

    @property
    def connections(self) -> int:
        """Connections open now, busy or idle."""
        return len(self._open)

    async def open(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """POST ``body`` to ``url`` and return once the status line and headers arrived."""
        slots = self._slots
        assert slots is not None, "Upstream.start() first"
        target = self._target(url)
        data = request_head(target.start, headers, len(body)) + body
        await slots.acquire()
        try:
            conn = self._idle_connection(target.origin)
            if conn is not None:
                try:
                    return await self._send(conn, data)
                except UpstreamDropped:
                    if not conn.closed_unheard:
                        raise
                    # The pod closed it as we reused it, so it took nothing of the
                    # request: a new connection carries it, once (a failure there is
                    # the pod's), rather than a retry elsewhere counted against the pod.
            return await self._send(await self._connect(target.origin), data)
        except BaseException:
            slots.release()
            raise

    async def _send(self, conn: _Connection, data: bytes) -> UpstreamResponse:
        """One exchange on ``conn``, once its head is in; any failure closes it."""
        try:
            await conn.send(data)
        except BaseException:
            conn.close()
            raise
        return UpstreamResponse(self, conn)

    # -- the pool --

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        return target

    def _idle_connection(self, origin: tuple[str, str, int]) -> _Connection | None:
        """The pod's most recently used idle connection (the least likely to be timing
        out), None if none is fresh."""
        idle = self._idle.get(origin)
        if not idle:
            return None
        self._close_timed_out(idle)
        if not idle:
            return None
        conn = next(reversed(idle))
        self._forget_idle(conn)
        return conn

    async def _connect(self, origin: tuple[str, str, int]) -> _Connection:
        if len(self._open) + self._connecting >= self._max_connections:
            self._close_oldest_idle()  # one is idle: fewer than max are busy (the semaphore)
        scheme, host, port = origin
        tls: dict[str, Any] = {}
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = {"ssl": self._ssl, "server_hostname": host}
        self._connecting += 1
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: _Connection(self, origin), host, port, **tls
                )
            self._open.add(conn)
        except TimeoutError:
            raise UpstreamConnectError(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:  # refused, unreachable, unresolvable, TLS
            raise UpstreamConnectError(repr(exc)) from None
        finally:
            self._connecting -= 1
        return conn

    def _release(self, conn: _Connection, *, reuse: bool) -> None:
        assert self._slots is not None
        self._slots.release()
        if reuse and conn.complete and conn.keep_alive and not conn.closed:
            conn.reset()
            conn.idle_since = self.loop.time()
            self._idle.setdefault(conn.origin, {})[conn] = None
        else:
            conn.close()

    def _close_oldest_idle(self) -> None:
        """Make room for a connection to another pod: close the longest idle one."""
        oldest = [next(iter(idle)) for idle in self._idle.values() if idle]
        if oldest:
            min(oldest, key=lambda conn: conn.idle_since).close()

    def bounds(self) -> dict[str, Bound]:
        """Open connections to pods, busy or idle (``/admin/bounds``)."""
        return {
            "upstream.connections": Bound(
                len(self._open), self._max_connections, "connections", CONNECTION_BYTES
            )
        }

    def _lost(self, conn: _Connection) -> None:
        """``conn`` closed (either end): forget it, idle or not."""
        self._open.discard(conn)
        self._forget_idle(conn)

    def _forget_idle(self, conn: _Connection) -> None:
        idle = self._idle.get(conn.origin)
        if idle is not None and conn in idle:
            del idle[conn]
            if not idle:
                del self._idle[conn.origin]

    async def _sweep_forever(self) -> None:
        """Close connections idle past ``IDLE_CLOSE_S`` (a pod that is no longer asked
        keeps none open)."""
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            for idle in list(self._idle.values()):
                self._close_timed_out(idle)

    def _close_timed_out(self, idle: dict[_Connection, None]) -> None:
        """Close a pod's idle connections unused for ``IDLE_CLOSE_S``: the oldest lead."""
        cutoff = self.loop.time() - IDLE_CLOSE_S
        while idle and (oldest := next(iter(idle))).idle_since < cutoff:
            oldest.close()  # which forgets it (and the pod's entry, once empty)
