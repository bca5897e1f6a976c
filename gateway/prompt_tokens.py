"""A request's prompt as the engine's token ids, per model.

Each model's prompts are rendered and tokenized the way vLLM will (``kvindex``'s
``Tokenization``): with its local tokenizer files, or by asking a pod's
``/tokenize`` (``tokenizer_mode: engine``, or a prompt the local renderer cannot
do). A pod whose ``/tokenize`` fails or hangs is followed by the next one. A reload
may give a model another tokenizer: the new one loads in a thread before it replaces
the old, so no request waits for it (``load`` then ``use_settings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Sequence

import httpx

from gateway.config import ModelSettings, Settings
from gateway.openai_body import ParsedRequest
from gateway.pods import Pod
from kvindex.tokenization.anthropic import messages_prompt
from kvindex.tokenization.engine import EngineTokenizer
from kvindex.tokenization.errors import UnsupportedPrompt
from kvindex.tokenization.front import Tokenization, TokenizationError
from kvindex.tokenization.local import LocalTokenizer
from kvindex.tokenization.prompt import ChatPrompt
from kvindex.tokenization.responses import responses_prompt
from kvindex.types import Bound

log = logging.getLogger("kvgate.kv")

TOKENIZE_ATTEMPTS = 2  # pods asked for /tokenize before routing by load alone


class PromptTokens:
    """Per model, how prompts become token ids; per pod, its ``/tokenize`` client."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient) -> None:
        self._s = settings
        self._client = client
        self._tokenizers: dict[str, Tokenization] = {}
        self._engines: dict[str, EngineTokenizer] = {}
        self._rotation = 0

    def tokenization(self, model: str) -> Tokenization:
        tok = self._tokenizers.get(model)
        if tok is None:
            ms = self._s.models.get(model) or ModelSettings()
            tok = self._tokenizers[model] = build_tokenization(model, ms)
        return tok

    async def warm_up(self, models: Iterable[str]) -> None:
        """Load these models' local tokenizers, and compile their chat templates, in a
        worker thread before the gateway serves: done on the first request, the
        transformers import and load (~1-2 s) would stall the event loop, and every
        request in flight with it. A tokenizer that fails is logged; requests then
        fall back as ``tokenization`` decides."""
        for model in models:
            try:
                await asyncio.to_thread(lambda m=model: _warm_tokenizer(self.tokenization(m)))
            except Exception as exc:  # noqa: BLE001  (a bad tokenizer must not stop start-up)
                log.warning("tokenizer for %s did not load: %r", model, exc)

    # -- a reload --------------------------------------------------------------------------

    async def load(self, settings: Settings, warm: Iterable[str]) -> dict[str, Tokenization]:
        """For a reload to ``settings``: the new tokenization of each model whose
        tokenizer settings changed and that is in use or in ``warm``, loaded and warmed
        in a thread (``use_settings`` swaps them in). One that fails to load is logged
        and left to load on first use, as at start-up."""
        warm = set(warm)
        fresh: dict[str, Tokenization] = {}
        for model in self._changes(settings):
            if model not in warm and model not in self._tokenizers:
                continue  # built on first use
            ms = settings.models.get(model) or ModelSettings()
            try:
                fresh[model] = await asyncio.to_thread(_loaded_tokenization, model, ms)
            except Exception as exc:  # noqa: BLE001  (as at start-up: logged, falls back)
                log.warning("tokenizer for %s did not load: %r", model, exc)
        return fresh

    def use_settings(self, settings: Settings, loaded: dict[str, Tokenization]) -> None:
        """Take new settings with the tokenizations ``load`` made for them."""
        changed = self._changes(settings)
        self._s = settings
        for model in changed:
            self._tokenizers.pop(model, None)
        self._tokenizers.update(loaded)
        self._engines.clear()  # a pod's key or timeouts.tokenize_s may have changed

    def _changes(self, settings: Settings) -> list[str]:
        """Models whose tokenizer settings differ between the running and ``settings``."""
        old = self._s
        models = set(old.models) | set(settings.models) | set(self._tokenizers)
        return [m for m in models if _tokenizer_of(old, m) != _tokenizer_of(settings, m)]

    # -- requests ------------------------------------------------------------------------

    async def token_ids(
        self, parsed: ParsedRequest, model: str, pods: list[Pod]
    ) -> Sequence[int] | None:
        """The prompt's token ids (None: not a prompt routed by cache), asking the next
        pod's ``/tokenize`` when one fails or times out (each call is bounded by
        ``timeouts.tokenize_s``): one pod whose tokenizer hangs must not hang the
        requests that happen to be sent to it."""
        # Spread engine-mode tokenization over the pods rather than loading the first.
        self._rotation += 1
        turns = [pods[(self._rotation + i) % len(pods)] for i in range(len(pods))] or [None]
        for i, pod in enumerate(turns[:TOKENIZE_ATTEMPTS]):
            engine = self._engine_for(pod) if pod is not None else None
            try:
                return await self._tokens(parsed, model, engine)
            except TokenizationError:
                if i + 1 >= min(len(turns), TOKENIZE_ATTEMPTS):
                    raise
        return None

    def forget_pod(self, name: str) -> None:
        self._engines.pop(name, None)

    def bounds(self) -> dict[str, Bound]:
        out = {f"token_cache[{m}]": tok.cache.bound() for m, tok in self._tokenizers.items()}
        for m, tok in self._tokenizers.items():
            words = tok.incremental.segmenter.words if tok.incremental is not None else None
            if words is not None:
                out[f"word_cache[{m}]"] = words.bound()
        return out

    def _engine_for(self, pod: Pod) -> EngineTokenizer:
        eng = self._engines.get(pod.name)
        if eng is None:
            eng = self._engines[pod.name] = EngineTokenizer(
                pod.url,
                client=self._client,
                timeout_s=self._s.timeouts.tokenize_s,
                api_key=pod.config.api_key,
            )
        return eng

    async def _tokens(
        self, parsed: ParsedRequest, model: str, engine: EngineTokenizer | None
    ) -> Sequence[int] | None:
        tok = self.tokenization(model)
        body = parsed.body
        if parsed.kind == "chat":
            return await tok.chat(ChatPrompt.from_body(body), engine=engine)
        if parsed.kind == "responses":
            return await tok.chat(responses_prompt(body), engine=engine)
        if parsed.kind == "messages":
            facts = tok.local.anthropic_facts if tok.local is not None else None
            return await tok.chat(messages_prompt(body, facts), engine=engine)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str):
            add_special = bool(body.get("add_special_tokens", True))
            return await tok.completion(prompt, add_special_tokens=add_special, engine=engine)
        return None  # batched prompts are not routed by cache


def build_tokenization(model: str, ms: ModelSettings) -> Tokenization:
    """How ``model``'s prompts become token ids: locally (its tokenizer files) or by a
    pod's ``/tokenize``. Loading a local tokenizer takes a second or two: callers on
    the event loop build it in a thread (``warm_up``) or on first use."""
    local = LocalTokenizer(ms.tokenizer) if ms.tokenizer and ms.tokenizer_mode != "engine" else None
    mode = ms.tokenizer_mode if local is not None or ms.tokenizer_mode == "engine" else "engine"
    return Tokenization(model, mode=mode, local=local)


def _warm_tokenizer(tok: Tokenization) -> Tokenization:
    local = tok.local
    if local is None:
        return tok
    local.encode("warm up", add_special_tokens=False)
    with contextlib.suppress(UnsupportedPrompt):  # a model without a chat template
        local.render_chat(ChatPrompt([{"role": "user", "content": "warm up"}]))
    local.anthropic_facts  # noqa: B018  (probes the template, a few renders)
    return tok


def _loaded_tokenization(model: str, ms: ModelSettings) -> Tokenization:
    return _warm_tokenizer(build_tokenization(model, ms))


def _tokenizer_of(settings: Settings, model: str) -> tuple[str | None, str]:
    ms = settings.models.get(model) or ModelSettings()
    return ms.tokenizer, ms.tokenizer_mode
