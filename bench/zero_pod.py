"""A zero-latency OpenAI backend for measuring what a router adds (``kvgate bench overhead``).

Answers chat and completion requests at once with a canned body (JSON, or an SSE
stream of three chunks with usage when the request asks ``"stream": true``), plus
``/health``, ``/v1/models`` and vLLM-style ``/metrics`` so routers admit it. A raw
asyncio protocol over httptools on uvloop: it must not be what limits requests/s,
since every router in the comparison sends to it, and on a small machine it shares
the router's cores, so what it spends a request the router does not get (answers are
built once per stream flag and length). It does no work a real engine does, so what
remains in a measurement through a router is the router.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import httptools
import uvloop

MODEL = "kvgate-tiny-llama"

_MODELS = json.dumps({"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": 0, "owned_by": "vllm", "root": MODEL,
     "parent": None, "max_model_len": 65536}]}).encode()  # fmt: skip
_METRICS = (
    b'vllm:num_requests_running{engine="0",model_name="' + MODEL.encode() + b'"} 0.0\n'
    b'vllm:num_requests_waiting{engine="0",model_name="' + MODEL.encode() + b'"} 0.0\n'
    b'vllm:kv_cache_usage_perc{engine="0",model_name="' + MODEL.encode() + b'"} 0.0\n'
)


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
            "total_tokens": prompt_tokens + 1,
            "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip


def _json_body(prompt_tokens: int) -> bytes:
    return json.dumps({
        "id": "chatcmpl-zero", "object": "chat.completion", "created": int(time.time()),
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "length"}],
        "usage": _usage(prompt_tokens)}).encode()  # fmt: skip


def _sse_body(prompt_tokens: int) -> bytes:
    def chunk(delta: dict[str, Any], finish: str | None, usage: Any = None) -> bytes:
        doc = {"id": "chatcmpl-zero", "object": "chat.completion.chunk", "created": 0,
               "model": MODEL, "choices": [{"index": 0, "delta": delta,
                                            "finish_reason": finish}]}  # fmt: skip
        if usage is not None:
            doc = {**doc, "choices": [], "usage": usage}
        return b"data: " + json.dumps(doc).encode() + b"\n\n"

    return (
        chunk({"role": "assistant", "content": ""}, None)
        + chunk({"content": "ok"}, "length")
        + chunk({}, None, _usage(prompt_tokens))
        + b"data: [DONE]\n\n"
    )


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + content_type
            + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip


# Whole responses by (stream, prompt tokens): the pod answers thousands of requests a
# second beside the router it measures, on the same cores, so what it spends a request
# is taken from that router. Bodies of one benchmark run fall in a few lengths.
_COMPLETIONS: dict[tuple[bool, int], bytes] = {}
_MAX_COMPLETIONS = 4096
_STREAM_KEY = b'"stream"'


def wants_stream(body: bytes | bytearray) -> bool:
    """Whether a JSON body sets ``"stream": true`` at its top level or anywhere (a canned
    pod need not tell them apart): the value after the first ``"stream"`` key."""
    at = body.find(_STREAM_KEY)
    if at < 0:
        return False
    rest = bytes(body[at + len(_STREAM_KEY) : at + len(_STREAM_KEY) + 16]).lstrip()
    return rest.startswith(b":") and rest[1:].lstrip().startswith(b"true")


def _completion(stream: bool, prompt_tokens: int) -> bytes:
    """The whole HTTP response to a completion request (built once per key; its
    ``created`` is the time it was built)."""
    out = _COMPLETIONS.get((stream, prompt_tokens))
    if out is None:
        if stream:
            out = _response(b"200 OK", b"text/event-stream", _sse_body(prompt_tokens))
        else:
            out = _response(b"200 OK", b"application/json", _json_body(prompt_tokens))
        if len(_COMPLETIONS) < _MAX_COMPLETIONS:
            _COMPLETIONS[(stream, prompt_tokens)] = out
    return out


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = bytearray()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        assert self.transport is not None
        path = self.url.split(b"?", 1)[0]
        if path in (b"/v1/chat/completions", b"/v1/completions"):
            out = _completion(wants_stream(self.body), max(1, len(self.body) // 4))
        elif path == b"/health":
            out = _response(b"200 OK", b"text/plain", b"")
        elif path == b"/v1/models":
            out = _response(b"200 OK", b"application/json", _MODELS)
        elif path == b"/metrics":
            out = _response(b"200 OK", b"text/plain", _METRICS)
        else:
            out = _response(b"404 Not Found", b"application/json", b'{"detail":"Not Found"}')
        self.transport.write(out)
        if not self.parser.should_keep_alive():
            self.transport.close()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Protocol, host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
