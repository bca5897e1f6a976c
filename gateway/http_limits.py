"""Limits on what a client may send and how slowly: header size and time, body size and time;
and what to do when it leaves.

A client that trickles its headers (slowloris), sends a megabyte of headers or never
finishes its body would otherwise hold a connection and an ASGI task as long as it
likes. uvicorn has no header timeout or header size limit for its httptools protocol,
so ``guarded_protocol`` adds both to it: the request line and headers must arrive
within ``headers_timeout_s`` of the connection opening (or of the previous response on
a kept-alive connection) and within ``max_header_bytes``; otherwise the client gets a
408 or a 431 and the connection is closed. The body is read by ``read_limited``
(413 above the size limit, 408 past its deadline).

Each connection a client holds open, busy or idle, costs the process a file descriptor
and its buffers, and nothing a client does bounds how many it opens: without a limit a
flood of connections runs the process out of descriptors, and then its connections to
the pods fail too (which ejects healthy pods). ``ClientConnections`` counts the serving
listener's connections; past ``max_client_connections`` a new one is answered 503 with
``Retry-After`` at once and closed, before anything is read from it. The admin listener
is not counted, so an operator can still look at a gateway that is full.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.asgi import DisconnectWatch, read_body
from gateway.errors import GatewayError
from gateway.in_flight import at_capacity
from kvindex.types import Bound

T = TypeVar("T")


async def read_limited(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """``read_body`` for a Starlette ``Request`` (the admin app's handlers)."""
    return await read_body(request.receive, dict(request.headers), limit, timeout_s)


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work`` unless the client leaves first (then it is cancelled: None).

    For Starlette handlers that wait a long time before answering (the simulated pod's
    non-streamed generation, as vLLM's own ``with_cancellation`` guards its handlers)."""
    watch = DisconnectWatch(request.receive)
    try:
        return await work
    except asyncio.CancelledError:
        if not watch.gone:
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        return None
    finally:
        watch.stop()


# What an open client connection holds in the process: uvicorn's protocol and its parser,
# the transport and its buffers (the kernel's socket buffers aside). Measured: a
# gateway's RSS grew 6,800-6,900 bytes a connection with 1,000, 2,000 and 4,000 silent
# connections open (python -m bench.idle_connections --connections N).
CONNECTION_BYTES = 7_000


class ClientConnections:
    """The serving listener's open client connections in this process, against
    ``limit`` (``max_client_connections``)."""

    def __init__(self, limit: int, on_refused: Callable[[], None] | None = None) -> None:
        """``on_refused``: called for each connection refused at the limit
        (``kvgate_requests_refused_total{bound="client_connections"}``)."""
        self.limit = limit
        self.open = 0
        self.on_refused = on_refused

    def admit(self) -> bool:
        """Count one more connection, or refuse it (False) at the limit."""
        if self.open >= self.limit:
            if self.on_refused is not None:
                self.on_refused()
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1

    def bounds(self) -> dict[str, Bound]:
        """``/admin/bounds``: the connections open now, against the limit."""
        return {"client_connections": Bound(self.open, self.limit, "connections", CONNECTION_BYTES)}


class _HeadersTooLarge(Exception):
    """Raised from a parser callback to stop parsing an oversized header block."""


def guarded_protocol(
    max_header_bytes: int,
    headers_timeout_s: float,
    connections: ClientConnections | None = None,
    admin_port: int | None = None,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a header size limit and a header deadline, and,
    given ``connections``, a limit on the open connections of every listener but the
    one on ``admin_port``."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_bytes = 0
            self._too_large = False
            self._headers_deadline: asyncio.TimerHandle | None = None
            self._counted = False
            # The request whose app runs. With requests pipelined behind it, uvicorn's
            # ``cycle`` is the newest, and only that one hears of the client leaving.
            self._answering: RequestResponseCycle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if connections is not None and not self._on_admin_listener():
                if not connections.admit():
                    why = f"{connections.limit} client connections are open"
                    self._reject(b"Service Unavailable", at_capacity(why))
                    return
                self._counted = True
            self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_arrived()
            answering = self._answering
            if answering is not None and answering is not self.cycle:
                # A request pipelined behind it: uvicorn tells only that one, and this
                # one's DisconnectWatch would not cancel its upstream request.
                if not answering.response_complete:
                    answering.disconnected = True
                    answering.message_event.set()
            if self._counted:
                self._counted = False
                connections.release()  # type: ignore[union-attr]
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            self._header_bytes = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._headers_arrived()
            before = self.cycle
            super().on_headers_complete()
            if before is None or before.response_complete:
                self._answering = self.cycle  # its app starts now (else it is queued)

        def on_response_complete(self) -> None:
            queued = self.pipeline[-1][0] if self.pipeline else None  # the next to start
            super().on_response_complete()
            if queued is not None and not (self.pipeline and self.pipeline[-1][0] is queued):
                self._answering = queued
            if not self.transport.is_closing():
                self._await_headers()  # the next request on this kept-alive connection

        def send_400_response(self, msg: str) -> None:
            if self._too_large:  # parsing stopped by _count, not by a malformed request
                self._reject(b"Request Header Fields Too Large",
                             GatewayError(431, "request headers too large"))  # fmt: skip
                return
            super().send_400_response(msg)

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > max_header_bytes:
                self._too_large = True
                raise _HeadersTooLarge

        def _await_headers(self) -> None:
            self._headers_arrived()
            self._headers_deadline = self.loop.call_later(headers_timeout_s, self._headers_late)

        def _headers_arrived(self) -> None:
            if self._headers_deadline is not None:
                self._headers_deadline.cancel()
                self._headers_deadline = None

        def _headers_late(self) -> None:
            self._headers_deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being answered; its own deadlines apply
            self._reject(b"Request Timeout",
                         GatewayError(408, "request headers not received in time"))  # fmt: skip

        def _on_admin_listener(self) -> bool:
            if admin_port is None:
                return False
            sockname = self.transport.get_extra_info("sockname")
            return isinstance(sockname, tuple) and sockname[1] == admin_port

        def _reject(self, reason: bytes, error: GatewayError) -> None:
            """Answer ``error`` (with its headers) and close: the connection is not in a
            state where a request can be read from it."""
            body = error.encoded()
            headers = b"".join(b"%s: %s\r\n" % (name.encode(), value.encode())
                               for name, value in error.headers.items())  # fmt: skip
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n%sconnection: close\r\n\r\n%s"
                % (error.status, reason, len(body), headers, body)
            )
            self.transport.close()

    return GuardedHttpToolsProtocol
