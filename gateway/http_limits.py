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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.asgi import DisconnectWatch, read_body
from gateway.errors import GatewayError

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


class _HeadersTooLarge(Exception):
    """Raised from a parser callback to stop parsing an oversized header block."""


def guarded_protocol(max_header_bytes: int, headers_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a header size limit and a header deadline."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_bytes = 0
            self._too_large = False
            self._headers_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_arrived()
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
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_headers()  # the next request on this kept-alive connection

        def send_400_response(self, msg: str) -> None:
            if self._too_large:  # parsing stopped by _count, not by a malformed request
                self._reject(431, b"Request Header Fields Too Large", "request headers too large")
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
            self._reject(408, b"Request Timeout", "request headers not received in time")

        def _reject(self, status: int, reason: bytes, message: str) -> None:
            body = GatewayError(status, message).response().body
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                % (status, reason, len(body), body)
            )
            self.transport.close()

    return GuardedHttpToolsProtocol
