"""A scripted upstream pod for in-process gateway tests: a raw asyncio HTTP/1.1 server.

Raw on purpose: it reads and writes HTTP/1.1 bytes itself, so the tests hold the
proxy to the wire protocol and not to whichever client library forwards upstream.
It runs in the test's own event loop. The test scripts what each proxied request
gets (a JSON answer, a 5xx, a dropped connection, a hang, an SSE stream that ends
or breaks); the pod records what it received and whether the gateway closed the
connection while the pod held it. ``/health``, ``/v1/models`` and ``/metrics``
always answer, so the gateway's registry admits the pod at start-up.

Responses carry a Content-Length or are chunked, so a connection stays usable for
the gateway's keep-alive pool; a scripted break leaves a chunked body unfinished,
which a client can tell from a clean end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.config import PodConfig

MODEL = "scripted-model"
PROBE_PATHS = ("/health", "/v1/models", "/metrics")
_REASONS = {200: "OK", 401: "Unauthorized", 500: "Internal Server Error",
            502: "Bad Gateway", 503: "Service Unavailable"}  # fmt: skip


@dataclass
class Received:
    """One proxied request as the pod read it off the wire."""

    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # the gateway hung up on us


class Wire:
    """The pod's end of one connection, for writing one response."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.keep_alive = True

    async def head(self, status: int, content_type: str, length: int | None) -> None:
        """Status line and headers; ``length=None`` announces a chunked body."""
        framing = "transfer-encoding: chunked" if length is None else f"content-length: {length}"
        head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
        head += f"content-type: {content_type}\r\n{framing}\r\n\r\n"
        await self.write(head.encode())

    async def write(self, data: bytes) -> None:
        self._writer.write(data)
        await self._writer.drain()

    async def chunk(self, data: bytes) -> None:
        await self.write(b"%x\r\n%s\r\n" % (len(data), data))

    async def end_chunks(self) -> None:
        await self.write(b"0\r\n\r\n")

    def drop(self) -> None:
        """Close the connection now, whatever was (not) sent."""
        self.keep_alive = False
        self._writer.close()

    async def hold(self, received: Received, until: asyncio.Event | None) -> bool:
        """Wait for ``until`` (None: forever) or the gateway closing the connection.

        Returns whether the gateway hung up; ``received.gone`` is set then."""
        eof = asyncio.ensure_future(self._reader.read(1))  # a client sends nothing mid-response
        waits: set[asyncio.Future[object]] = {eof}
        if until is not None:
            waits.add(asyncio.ensure_future(until.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            # Until the cancelled read has run, the reader is still taken: the next
            # request on this connection could not be read.
            await asyncio.gather(*waits, return_exceptions=True)
        if eof.done() and not eof.cancelled() and (eof.exception() or eof.result() == b""):
            received.gone.set()
            self.drop()
            return True
        return False


Behaviour = Callable[[Wire, Received], Awaitable[None]]


def answer(body: object, status: int = 200) -> Behaviour:
    """A JSON response with a Content-Length (the connection stays alive)."""
    data = json.dumps(body).encode()

    async def respond(wire: Wire, received: Received) -> None:
        await wire.head(status, "application/json", len(data))
        await wire.write(data)

    return respond


def drop() -> Behaviour:
    """Accept the request, then close the connection before sending a single byte."""

    async def respond(wire: Wire, received: Received) -> None:
        wire.drop()

    return respond


def hang(until: asyncio.Event | None = None, then: Behaviour | None = None) -> Behaviour:
    """Send nothing until ``until`` is set (None: never), then behave like ``then``."""

    async def respond(wire: Wire, received: Received) -> None:
        if await wire.hold(received, until):
            return
        await (then or drop())(wire, received)

    return respond


def stream(
    pieces: Sequence[bytes],
    *,
    delay_s: float = 0.0,
    ending: Literal["complete", "break", "hold"] = "complete",
    before_first: asyncio.Event | None = None,
) -> Behaviour:
    """An SSE response, each piece its own chunk and TCP write, ``delay_s`` apart.

    ``ending``: "complete" ends the chunked body cleanly; "break" closes the
    connection mid-body; "hold" keeps it open until the gateway hangs up.
    ``before_first``: the head goes out at once, the first piece once it is set (as
    vLLM sends its headers on accepting a request, its first token after prefill)."""

    async def respond(wire: Wire, received: Received) -> None:
        await wire.head(200, "text/event-stream", None)
        if before_first is not None:
            await before_first.wait()
        for i, piece in enumerate(pieces):
            if i and delay_s:
                await asyncio.sleep(delay_s)
            await wire.chunk(piece)
        if ending == "complete":
            await wire.end_chunks()
        elif ending == "break":
            wire.drop()
        else:
            await wire.hold(received, None)

    return respond


def sse(obj: object) -> bytes:
    """One SSE event carrying ``obj`` as JSON, as vLLM writes it."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def completion(text: str = "ok", prompt_tokens: int = 10, cached_tokens: int = 0) -> dict:
    """A chat completion body with its usage, as vLLM answers it."""
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 1,
            "total_tokens": prompt_tokens + 1,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        },
    }


def delta(text: str) -> dict:
    """One streamed chat chunk carrying ``text``."""
    return {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": text}}]}  # fmt: skip


class ScriptedPod:
    """One upstream pod on 127.0.0.1; proxied requests get the scripted behaviours in order.

    With the script used up, a request gets ``default`` (a 200 chat completion)."""

    def __init__(self, name: str, api_key: str | None = None) -> None:
        self.name = name
        self.api_key = api_key
        self.received: list[Received] = []
        self.default: Behaviour = answer(completion(text=f"from {name}"))
        # what /v1/models lists: the model, and LoRA adapters as cards with a parent
        self.cards: list[dict[str, object]] = [{"id": MODEL, "object": "model", "parent": None}]
        self.model_reads = 0  # GET /v1/models answered
        self._script: deque[Behaviour] = deque()
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.StreamWriter, asyncio.Task[object]] = {}
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config(self) -> PodConfig:
        return PodConfig(name=self.name, url=self.url, api_key=self.api_key)

    def script(self, *behaviours: Behaviour) -> None:
        self._script.extend(behaviours)

    def load_adapter(self, name: str) -> None:
        """List a LoRA adapter of ``MODEL`` from now on (vLLM's /v1/load_lora_adapter)."""
        self.cards.append({"id": name, "object": "model", "parent": MODEL})

    def unload_adapter(self, name: str) -> None:
        self.cards = [c for c in self.cards if c["id"] != name]

    async def start(self) -> ScriptedPod:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stop listening and cut every open connection: the port now refuses connections."""
        if self._server is not None:
            self._server.close()
        for writer, task in list(self._connections.items()):
            writer.close()
            task.cancel()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()  # the FIN is out: a pooled client sees it
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[writer] = task
        try:
            while (received := await _read_request(reader)) is not None:
                wire = Wire(reader, writer)
                await self._respond(wire, received)
                if not wire.keep_alive:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self._connections.pop(writer, None)
            writer.close()

    async def _respond(self, wire: Wire, received: Received) -> None:
        if received.path.startswith("/v1/") and self.api_key is not None:
            if received.headers.get("authorization") != f"Bearer {self.api_key}":
                return await answer({"error": "wrong key for the pod"}, 401)(wire, received)
        if received.method == "GET" and received.path in PROBE_PATHS:
            return await self._probe(wire, received.path)
        self.received.append(received)
        behaviour = self._script.popleft() if self._script else self.default
        await behaviour(wire, received)

    async def _probe(self, wire: Wire, path: str) -> None:
        if path == "/v1/models":
            self.model_reads += 1
            data = json.dumps({"object": "list", "data": self.cards}).encode()
            media = "application/json"
        elif path == "/metrics":  # an idle engine, as vLLM reports it
            data = b"".join(
                b'vllm:%s{model_name="%s"} 0.0\n' % (gauge, MODEL.encode())
                for gauge in (b"num_requests_waiting", b"num_requests_running",
                              b"kv_cache_usage_perc")
            )  # fmt: skip
            media = "text/plain; version=0.0.4"
        else:
            data, media = b"", "text/plain"
        await wire.head(200, media, len(data))
        await wire.write(data)


async def _read_request(reader: asyncio.StreamReader) -> Received | None:
    """The next request on a keep-alive connection; None when the client closed it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    method, target, _ = request_line.split(" ", 2)
    headers = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = await _read_chunked(reader)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Received(method, target.split("?", 1)[0], headers, body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while size := int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16):
        body += await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after each chunk
    await reader.readuntil(b"\r\n")  # no trailers are sent to a pod
    return bytes(body)
