"""Turning one engine run into a vLLM-shaped response: whole body or SSE stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from bench.sim import protocol as p
from bench.sim.engine import Admission, SimEngine

DONE = "data: [DONE]\n\n"


class DroppedStream(Exception):
    """Raised mid-body on purpose (fault ``drop_mid_stream``): the server aborts the connection."""


@dataclass(frozen=True, slots=True)
class Generation:
    kind: Literal["chat", "completion"]
    model: str
    prompt: list[int]
    max_tokens: int
    cache_salt: str | None = None
    include_usage: bool = False
    continuous_usage: bool = False
    lora: tuple[int, str] | None = None  # (lora_id, name) when the model is an adapter

    @property
    def id_prefix(self) -> str:
        return "chatcmpl" if self.kind == "chat" else "cmpl"


def _final_usage(gen: Generation, adm: Admission, completion: int, final_chunk: bool) -> dict:
    # vLLM reports created_cache_tokens for chat only (null for completions).
    created = adm.created_cache_tokens if gen.kind == "chat" else None
    return p.usage(adm.prompt_tokens, completion, adm.cached_tokens, created, final_chunk)


async def run_to_end(engine: SimEngine, gen: Generation) -> tuple[Admission, str, int]:
    """Generate the whole answer: (admission, text, output tokens)."""
    pieces: list[str] = []
    async with engine.session(gen.prompt, gen.max_tokens, gen.cache_salt, gen.lora) as run:
        adm = await engine.prefill(run)
        async for token in engine.tokens(run):
            pieces.append(engine.tokenizer.piece(token))
    return adm, "".join(pieces), len(pieces)


async def complete(engine: SimEngine, gen: Generation) -> dict:
    """Run to the end and return the non-streaming response body."""
    adm, text, n = await run_to_end(engine, gen)
    body_usage = _final_usage(gen, adm, n, final_chunk=False)
    rid, fp = p.new_id(gen.id_prefix), p.fingerprint()
    if gen.kind == "chat":
        return p.chat_response(rid, gen.model, text, "length", body_usage, fp)
    return p.completion_response(rid, gen.model, text, "length", body_usage, fp)


def _sse(obj: dict) -> str:
    return f"data: {p.dumps(obj)}\n\n"


async def stream(
    engine: SimEngine, gen: Generation, drop_after: int | None = None
) -> AsyncIterator[str]:
    """SSE events exactly as vLLM sends them; ``drop_after`` chunks then abort (fault)."""
    rid, created, fp = p.new_id(gen.id_prefix), int(time.time()), p.fingerprint()
    sent = 0

    def emit(obj: dict) -> str:
        nonlocal sent
        if drop_after is not None and sent >= drop_after:
            raise DroppedStream(rid)
        sent += 1
        return _sse(obj)

    async with engine.session(gen.prompt, gen.max_tokens, gen.cache_salt, gen.lora) as run:
        adm = await engine.prefill(run)
        if gen.kind == "chat":
            first = p.chat_chunk(rid, created, gen.model, {"role": "assistant", "content": ""},
                                 None, first=True)  # fmt: skip
            if gen.continuous_usage:
                first["usage"] = p.usage(adm.prompt_tokens, 0)
            first.update(prompt_token_ids=None, prompt_text=None)
            yield emit(first)
        n = 0
        async for token in engine.tokens(run):
            n += 1
            chunk = _token_chunk(gen, rid, created, engine.tokenizer.piece(token), n)
            if gen.continuous_usage:
                chunk["usage"] = p.usage(adm.prompt_tokens, n)
            if n == gen.max_tokens and not gen.include_usage:
                chunk["system_fingerprint"] = fp
            yield emit(chunk)
    if gen.include_usage:
        yield emit(
            {
                "id": rid,
                "object": "chat.completion.chunk" if gen.kind == "chat" else "text_completion",
                "created": created,
                "model": gen.model,
                "choices": [],
                "usage": _final_usage(gen, adm, n, final_chunk=True),
                "system_fingerprint": fp,
            }
        )
    yield DONE


def _token_chunk(gen: Generation, rid: str, created: int, text: str, n: int) -> dict:
    reason = "length" if n == gen.max_tokens else None
    if gen.kind == "chat":
        return p.chat_chunk(rid, created, gen.model, {"content": text}, reason, first=False)
    return p.completion_chunk(rid, created, gen.model, text, reason)
