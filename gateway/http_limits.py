"""Limits on what a client may send and how slowly: header size and time, body size and time.

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
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import GatewayError

T = TypeVar("T")


async def read_limited(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """Read the body: 413 as soon as it is known to exceed ``limit``, 408 if it takes
    longer than ``timeout_s`` (a slow client must not hold a slot forever)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body exceeds the {limit}-byte limit", code="too_large")
    chunks = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                chunks += chunk
                if len(chunks) > limit:
                    raise GatewayError(
                        413, f"request body exceeds the {limit}-byte limit", code="too_large"
                    )
    except TimeoutError:
        raise GatewayError(408, f"request body not received within {timeout_s:g} s",
                           code="request_timeout") from None  # fmt: skip
    return bytes(chunks)


async def unless_client_leaves(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Run ``work`` until it answers; cancel it (and return None) if the client leaves.

    The body has been read, so the next ASGI message is the client's disconnect.
    Starlette notices it only while streaming a response; before that (tokenizing,
    waiting for a pod's first byte, reading a whole non-streamed answer) nobody would,
    and the pod would go on computing an answer nobody reads. (vLLM guards its own
    handlers the same way: ``with_cancellation``.)"""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left, or we are being cancelled ourselves
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return None
    return task.result()


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
