"""Raw ASGI for the hot path: headers, body, responses and the client's leaving.

The proxied endpoints skip Starlette's ``Request``/``Response`` objects and FastAPI's
middleware stack (each costs tens of microseconds a request, measured in
docs/performance.md) and speak ASGI directly with these few helpers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Protocol

from gateway.errors import ErrorStyle, GatewayError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]


def header_map(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name (ASGI servers send them lower-case);
    a repeated header keeps its last value."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}


class BodyCharge(Protocol):
    def charge(self, n: int) -> None: ...


async def read_body(
    receive: Receive,
    headers: dict[str, str],
    limit: int,
    timeout_s: float | None,
    hold: BodyCharge | None = None,
) -> bytes:
    """The whole request body: 413 as soon as it is known to exceed ``limit``, 408 if it
    does not arrive within ``timeout_s`` (a slow client must not hold a slot forever).
    ``hold`` is charged its bytes before they are read: a declared length at once, else
    each chunk as it comes (``gateway.in_flight``; it raises to refuse them)."""
    declared = headers.get("content-length")
    length = int(declared) if declared is not None and declared.isdigit() else None
    if length is not None and length > limit:
        raise GatewayError(413, f"request body exceeds the {limit}-byte limit", code="too_large")
    per_chunk = hold if length is None else None  # a declared length is charged whole
    if hold is not None and length is not None:
        hold.charge(length)  # the server reads no more than it
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientLeft
                chunk = message.get("body", b"")
                if per_chunk is not None:
                    per_chunk.charge(len(chunk))
                body += chunk
                if len(body) > limit:
                    raise GatewayError(
                        413, f"request body exceeds the {limit}-byte limit", code="too_large"
                    )
                if not message.get("more_body", False):
                    return bytes(body)
    except TimeoutError:
        raise GatewayError(408, f"request body not received within {timeout_s:g} s",
                           code="request_timeout") from None  # fmt: skip


class ClientLeft(Exception):
    """The client disconnected before its request could be answered."""


def encode_headers(headers: Iterable[tuple[str, str]]) -> RawHeaders:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]


async def send_response(send: Send, status: int, headers: RawHeaders, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send, err: GatewayError, headers: dict[str, str], style: ErrorStyle = "openai"
) -> None:
    """``err`` in the called API's shape, with ``headers`` (e.g. the request id)."""
    raw = [(b"content-type", b"application/json"), *encode_headers(headers.items())]
    await send_response(send, err.status, raw, err.encoded(style))


class DisconnectWatch:
    """Cancels the current task when the client disconnects (until ``stop``).

    The body has been read, so the next ASGI message is the client's disconnect. Servers
    do not interrupt a handler for it (uvicorn silently drops what is sent after), so
    without a watcher the pod would go on computing an answer nobody reads. One task
    per request, from the end of the body to the end of the answer.

    The watcher is never cancelled: a pending ``receive`` returns ``http.disconnect``
    once the response is complete (uvicorn wakes it then; ASGI answers any
    ``receive`` after the response so), and a stopped watcher takes that as its end. A
    cancelled one left a reference cycle per request (the cancellation's traceback
    holds the frames that hold the tasks), about 20 objects a request for the cyclic
    collector to find."""

    __slots__ = ("_task", "_watcher", "gone", "_stopped")

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._stopped = False
        self._task = asyncio.current_task()
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        task, self._task = self._task, None
        if not self._stopped:
            self.gone = True
            if task is not None:
                task.cancel()

    def stop(self) -> None:
        """The answer is complete (or about to be): the client may leave now."""
        self._stopped = True
