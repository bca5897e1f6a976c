"""The gateway in-process: ``create_app``, its lifespan run in the test's own event loop.

Plain requests go through httpx's ``ASGITransport``, which hands over a response
only once it is complete. ``StreamingCall`` talks ASGI to the app directly instead:
it sees every body message as the app sends it, and its client can leave at any
moment (``http.disconnect``), as a real one closing its socket would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from bench.polling import wait_for_async
from gateway.app import create_app
from gateway.config import Settings, SettingsSource
from gateway.state import Gateway
from tests.inproc.scripted_pod import MODEL, ScriptedPod

# Fast enough for sub-second tests. Pods are probed once, at start-up, and not again
# during a test: admission is the start-up probe's doing, ejection the requests'.
FAST: dict[str, dict[str, float]] = {
    "health": {"interval_s": 3600, "probe_timeout_s": 1.0},
    "retry": {"max_attempts": 3, "backoff_s": 0.001},
    "timeouts": {"connect_s": 1.0, "first_byte_s": 2.0, "total_s": 5.0},
}

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
STREAM_CHAT = {**CHAT, "stream": True}
ANTHROPIC = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
AUDIO = {"files": {"file": ("a.wav", b"RIFF....", "audio/wav")}, "data": {"model": MODEL}}
# One valid request (httpx keyword arguments) per path the gateway serves.
API_REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"json": CHAT},
    "/v1/completions": {"json": {"model": MODEL, "prompt": "hello"}},
    "/v1/responses": {"json": {"model": MODEL, "input": "hello"}},
    "/v1/messages": {"json": ANTHROPIC},
    "/v1/messages/count_tokens": {"json": ANTHROPIC},
    "/v1/embeddings": {"json": {"model": MODEL, "input": "hello"}},
    "/tokenize": {"json": {"model": MODEL, "prompt": "hello"}},
    "/detokenize": {"json": {"model": MODEL, "tokens": [1, 2]}},
    "/pooling": {"json": {"model": MODEL, "input": "hello"}},
    "/classify": {"json": {"model": MODEL, "input": "hello"}},
    "/v1/score": {"json": {"model": MODEL, "text_1": "a", "text_2": "b"}},
    "/score": {"json": {"model": MODEL, "text_1": "a", "text_2": "b"}},
    "/v1/rerank": {"json": {"model": MODEL, "query": "q", "documents": ["a"]}},
    "/rerank": {"json": {"model": MODEL, "query": "q", "documents": ["a"]}},
    "/v2/rerank": {"json": {"model": MODEL, "query": "q", "documents": ["a"]}},
    "/v1/audio/transcriptions": AUDIO,
    "/v1/audio/translations": AUDIO,
}


@dataclass
class InprocGateway:
    app: FastAPI
    client: httpx.AsyncClient  # the serving app, through ASGITransport: whole responses
    admin: httpx.AsyncClient  # the admin app (its own listener in production)

    @property
    def gw(self) -> Gateway:
        return self.app.state.gw

    def series(self, **labels: str) -> list[str]:
        """Every exposed sample whose labels include ``labels``, as ``name{labels}``."""
        return [
            f"{sample.name}{sample.labels}"
            for family in self.gw.prometheus.collect()
            for sample in family.samples
            if labels.items() <= sample.labels.items()
        ]

    def label_values(self, label: str) -> set[str]:
        """The values ``label`` has in the exposed samples ("" left out)."""
        return {
            value
            for family in self.gw.prometheus.collect()
            for sample in family.samples
            if (value := sample.labels.get(label, ""))
        }

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        return sum(
            sample.value
            for family in self.gw.prometheus.collect()
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def failures(self, pod: str) -> int:
        """The pod's consecutive failed requests, as the registry counts them to eject it."""
        return self.gw.registry.get(pod).failed_requests

    def in_rotation(self, pod: str) -> bool:
        return self.gw.registry.get(pod).healthy

    def load(self, pod: str) -> int:
        """Requests the routing core counts against ``pod`` right now."""
        return self.gw.router.core.load.get(pod).in_flight

    async def chat(self, body: dict | None = None, **kwargs: Any) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json=body or CHAT, **kwargs)

    def stream_chat(self, body: dict | None = None) -> StreamingCall:
        return StreamingCall(self.app, "/v1/chat/completions", json.dumps(body or STREAM_CHAT))

    def stream(self, path: str, body: dict) -> StreamingCall:
        return StreamingCall(self.app, path, json.dumps(body))


@contextlib.asynccontextmanager
async def inproc_gateway(*pods: ScriptedPod, **settings: Any) -> AsyncIterator[InprocGateway]:
    """A started gateway in front of ``pods``; ``FAST`` settings unless overridden.

    A section given as a dict changes only the fields it names:
    ``timeouts={"first_byte_s": 0.2}`` keeps ``FAST``'s other timeouts."""
    sections = {name: {**fields, **settings.pop(name, {})} for name, fields in FAST.items()}
    app = create_app(Settings(pods=[p.config for p in pods], **sections, **settings))
    async with _started(app) as g:
        yield g


@contextlib.asynccontextmanager
async def file_configured_gateway(config_file: Path) -> AsyncIterator[InprocGateway]:
    """A started gateway whose settings come from ``config_file`` as ``kvgate serve
    --config`` reads them, and are reloaded from it (``POST /admin/reload``)."""
    source = SettingsSource(config_file)
    async with _started(create_app(source.load(), source=source)) as g:
        yield g


@contextlib.asynccontextmanager
async def _started(app: FastAPI) -> AsyncIterator[InprocGateway]:
    serving = httpx.ASGITransport(app=app)
    admin = httpx.ASGITransport(app=app.state.admin_app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=serving, base_url="http://kvgate") as client,
        httpx.AsyncClient(transport=admin, base_url="http://kvgate-admin") as admin_client,
    ):
        yield InprocGateway(app, client, admin_client)


class StreamingCall:
    """One POST sent straight to the ASGI app, its response recorded message by message."""

    def __init__(self, app: FastAPI, path: str, body: str) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []  # non-empty body messages, in order
        self.complete = False  # the app sent its last body message
        self._body = body.encode()
        self._asked = False
        self._left = asyncio.Event()
        self._answered = asyncio.Event()  # the response is complete
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},  # spec < 2.4: Starlette listens for http.disconnect
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"kvgate"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self._body)).encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("kvgate", 80),
        }
        self._task = asyncio.create_task(app(scope, self._receive, self._send))

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def leave(self) -> None:
        """The client goes away: its next ``receive`` is ``http.disconnect``."""
        self._left.set()

    async def received(self, n_chunks: int) -> None:
        await wait_for_async(
            lambda: len(self.chunks) >= n_chunks, 2.0, f"{n_chunks} body chunks", poll=0.002
        )

    async def finished(self, timeout: float = 2.0) -> None:
        """The app returned (its clean-up, in ``finally`` blocks, has run)."""
        await asyncio.wait_for(asyncio.shield(self._task), timeout)

    async def _receive(self) -> dict[str, Any]:
        if not self._asked:
            self._asked = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        # As uvicorn: a receive pending when the response completes ends then too.
        left, answered = (asyncio.ensure_future(e.wait()) for e in (self._left, self._answered))
        try:
            await asyncio.wait((left, answered), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            answered.cancel()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            if message.get("body"):
                self.chunks.append(message["body"])
            self.complete = not message.get("more_body", False)
            if self.complete:
                self._answered.set()
