"""The simulated pod's HTTP face: vLLM 0.32's OpenAI server (chat, completions,
Responses, Anthropic Messages, LoRA adapters), metrics and admin routes.

``create_app(config)`` builds one independent pod (its own tokenizer, cache,
metrics registry and KV-event sockets); several can share a process.
Sim-only routes live under ``/sim/`` so they never collide with vLLM's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from bench.sim import protocol as p
from bench.sim.config import SimConfig
from bench.sim.engine import SimEngine
from bench.sim.errors import ApiError, bad_request
from bench.sim.faults import FaultInjector, FaultSpec
from bench.sim.generation import DroppedStream, Generation, complete, stream
from bench.sim.lora import LoraAdapters, LoraLimit
from bench.sim.messages_api import add_messages_routes
from bench.sim.responses_api import add_responses_routes
from bench.sim.tokenizer import PromptError, SimTokenizer
from gateway.http_limits import unless_client_leaves
from kvindex.tokenization import ChatPrompt, LocalTokenizer, UnsupportedPrompt


class SimPodState:
    """What the route handlers share: config, engine, faults."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.tokenizer = SimTokenizer(config.tokenizer_dir())
        self.engine = SimEngine(config, self.tokenizer)
        self.faults = FaultInjector()
        self.last_authorization: str | None = None  # for tests of what a gateway forwards
        self.adapters = LoraAdapters(config.lora_modules, config.max_lora_adapters)
        self._renderer: LocalTokenizer | None = None

    def check_model(self, model: str | None) -> tuple[int, str] | None:
        """The adapter a request names (None: the base model); 404 for anything else."""
        if model is None or model == self.config.model:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Valid aliases: {self.config.model}.",
                "NotFoundError",
                "model",
            )
        return lora

    @property
    def renderer(self) -> LocalTokenizer:
        """vLLM's chat rendering (``kvindex``), for Responses and Messages prompts: the
        e2e tests hold it to vLLM's own renderer."""
        if self._renderer is None:
            self._renderer = LocalTokenizer(self.config.tokenizer_dir())
        return self._renderer

    def render(self, prompt: ChatPrompt) -> list[int]:
        """Token ids of a converted Responses/Messages prompt, rendered as vLLM does."""
        try:
            text = self.renderer.render_chat(prompt)
        except UnsupportedPrompt as exc:
            raise bad_request(f"the simulator renders text only: {exc}") from exc
        return self.renderer.encode(text, prompt.add_special_tokens)

    def check_lengths(self, prompt: list[int], max_tokens: int | None, param: str) -> int:
        """vLLM's context checks; returns the output budget actually used."""
        limit = self.config.max_model_len
        if len(prompt) > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt contains at least {len(prompt)} input tokens, which exceeds this "
                "limit even without any output tokens. Please reduce the length of the input "
                f"prompt. (parameter=input_tokens, value={len(prompt)})",
                "input_tokens",
            )
        wanted = self.config.default_max_tokens if max_tokens is None else max_tokens
        if wanted > limit:
            raise bad_request(
                f"{param}={wanted} cannot be greater than max_model_len={limit}. Please "
                f"request fewer output tokens. (parameter={param}, value={wanted})",
                param,
            )
        if wanted < 1:
            raise bad_request(f"{param} must be at least 1, got {wanted}.", param)
        return max(1, min(wanted, limit - len(prompt)))


def _validation_handler(_: Request, exc: Exception) -> JSONResponse:
    """vLLM's RequestValidationError answer: 400, type "Bad Request", dotted param."""
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    lines = []
    for err in errors[:10]:
        shown = {k: v for k, v in err.items() if k in ("type", "loc", "msg", "input", "ctx")}
        shown["loc"] = ".".join(str(x) for x in err.get("loc", ()))
        if isinstance(shown.get("input"), list | dict):
            shown["input"] = f"<{type(shown['input']).__name__} of {len(shown['input'])} items>"
        lines.append(f"  {shown}"[:1002])
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(lines)
    param = ".".join(str(x) for x in errors[0].get("loc", ())) if errors else None
    body = p.error_body(message, HTTPStatus.BAD_REQUEST.phrase, 400, param)
    return JSONResponse(body, status_code=400)


def create_app(config: SimConfig | None = None) -> FastAPI:
    """One simulated vLLM pod as an ASGI app."""
    state = SimPodState(config or SimConfig())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        state.engine.close()

    app = FastAPI(title="kvgate sim (vLLM 0.32 API)", lifespan=lifespan)
    app.state.sim = state
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"])
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(ApiError, lambda _, exc: exc.response())  # type: ignore[arg-type,return-value]
    _add_generation_routes(app, state)
    add_responses_routes(app, state)
    add_messages_routes(app, state)
    _add_info_routes(app, state)
    if state.config.allow_runtime_lora_updating:
        _add_lora_routes(app, state)
    _add_sim_routes(app, state)
    return app


def _add_generation_routes(app: FastAPI, state: SimPodState) -> None:
    model = state.config.model

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatRequest, request: Request) -> Response:
        lora = state.check_model(body.model)
        state.last_authorization = request.headers.get("authorization")
        try:
            prompt = state.tokenizer.encode_chat(
                body.messages,
                add_generation_prompt=body.add_generation_prompt,
                add_special_tokens=body.add_special_tokens,
                template_kwargs={
                    **(body.chat_template_kwargs or {}),
                    **({"continue_final_message": True} if body.continue_final_message else {}),
                },
            )
        except PromptError as exc:
            raise bad_request(str(exc), "messages") from exc
        if body.max_completion_tokens is not None:
            budget = state.check_lengths(
                prompt, body.max_completion_tokens, "max_completion_tokens"
            )
        else:
            budget = state.check_lengths(prompt, body.max_tokens, "max_tokens")
        gen = Generation("chat", body.model or model, prompt, budget, lora=lora)
        return await _serve(state, request, body, gen)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        lora = state.check_model(body.model)
        state.last_authorization = request.headers.get("authorization")
        try:
            prompt = state.tokenizer.encode_prompt(body.prompt, body.add_special_tokens)
        except PromptError as exc:
            raise bad_request(str(exc), "prompt") from exc
        budget = state.check_lengths(prompt, body.max_tokens, "max_tokens")
        gen = Generation("completion", body.model or model, prompt, budget, lora=lora)
        return await _serve(state, request, body, gen)


async def _serve(
    state: SimPodState, request: Request, body: p._Generation, gen: Generation
) -> Response:
    if body.n not in (None, 1):
        raise bad_request("the simulator serves n=1 only", "n")
    include, continuous = body.usage_flags()
    gen = Generation(
        gen.kind,
        gen.model,
        gen.prompt,
        gen.max_tokens,
        body.cache_salt,
        include,
        continuous,
        gen.lora,
    )
    fault = state.faults.take()
    if fault == "error_500":
        raise ApiError(500, "Simulated engine failure (sim fault error_500)", "InternalServerError")
    if fault == "hang":
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)
        return Response(status_code=499)
    drop = fault == "drop_mid_stream"
    if body.stream:
        events = stream(state.engine, gen, drop_after=1 if drop else None)
        return StreamingResponse(events, media_type="text/event-stream")
    done = await unless_client_leaves(request, complete(state.engine, gen))
    if done is None:  # vLLM's with_cancellation: the client left, the request is aborted
        return Response(status_code=499)
    result = p.dumps(done).encode()
    if drop:
        return _truncated(result)
    return Response(result, media_type="application/json")


def _truncated(body: bytes) -> StreamingResponse:
    """Announce the full length, send half, then abort the connection."""

    async def half() -> AsyncIterator[bytes]:
        yield body[: len(body) // 2]
        raise DroppedStream("sim fault drop_mid_stream")

    headers = {"content-length": str(len(body))}
    return StreamingResponse(half(), media_type="application/json", headers=headers)


def _add_info_routes(app: FastAPI, state: SimPodState) -> None:
    cfg, tok = state.config, state.tokenizer

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": "0.32.0"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        now = int(time.time())
        cards = [p.model_card(cfg.model, str(tok.path), cfg.max_model_len, now)]
        cards += [
            p.model_card(name, f"/adapters/{name}", cfg.max_model_len, now, parent=cfg.model)
            for name in state.adapters.names()
        ]
        return {"object": "list", "data": cards}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest, request: Request) -> Any:
        state.check_model(body.model)
        if state.faults.take(tokenize=True) == "hang_tokenize":
            while not await request.is_disconnected():
                await asyncio.sleep(0.2)
            return Response(status_code=499)
        try:
            ids = _tokenize(state, body)
        except PromptError as exc:
            raise bad_request(str(exc)) from exc
        return {"count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids,
                "token_strs": None}  # fmt: skip

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> dict[str, str]:
        state.check_model(body.model)
        if any(t < 0 or t >= tok.vocab_size for t in body.tokens):
            raise bad_request("token id out of vocabulary", "tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}


def _tokenize(state: SimPodState, body: p.TokenizeRequest) -> list[int]:
    if body.messages is not None:
        special = False if body.add_special_tokens is None else body.add_special_tokens
        return state.tokenizer.encode_chat(body.messages, body.add_generation_prompt, special)
    if body.prompt is None:
        raise PromptError("either prompt or messages is required")
    special = True if body.add_special_tokens is None else body.add_special_tokens
    return state.tokenizer.encode_prompt(body.prompt, special)


def _add_lora_routes(app: FastAPI, state: SimPodState) -> None:
    """vLLM's runtime adapter endpoints (plain-text success, its error messages)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: p.LoadLoraRequest) -> Response:
        name = body.lora_name
        if not name or not body.lora_path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           "InvalidUserInput")  # fmt: skip
        if name == state.config.model:
            raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base "
                           "model.", "InvalidUserInput")  # fmt: skip
        try:
            loaded = state.adapters.load(name)
        except LoraLimit as exc:
            raise ApiError(500, str(exc), "InternalServerError") from exc
        if not loaded and not body.load_inplace:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you "
                           "want to load the adapter in place, set 'load_inplace' to True.",
                           "InvalidUserInput")  # fmt: skip
        return Response(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: p.UnloadLoraRequest) -> Response:
        name = body.lora_name
        if not name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                           "InvalidUserInput")  # fmt: skip
        if not state.adapters.unload(name):
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.")


def _add_sim_routes(app: FastAPI, state: SimPodState) -> None:
    engine = state.engine
    clear: Callable[[], int] = engine.reset_prefix_cache

    @app.post("/sim/faults")
    async def faults(spec: FaultSpec) -> dict[str, object]:
        state.faults.arm(spec)
        return state.faults.state()

    @app.get("/sim/state")
    async def sim_state() -> dict[str, Any]:
        return {**engine.state(), "faults": state.faults.state(),
                "last_authorization": state.last_authorization}  # fmt: skip

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        # vLLM serves this in dev mode; it publishes AllBlocksCleared.
        clear()
        return Response(status_code=200)
