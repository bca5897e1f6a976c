"""A request's prompt as the engine's token ids, per model.

Each model's prompts are rendered and tokenized the way vLLM will (``kvindex``'s
``Tokenization``): with its local tokenizer files, or by asking a pod's
``/tokenize`` (``tokenizer_mode: engine``, or a prompt the local renderer cannot
do). A pod whose ``/tokenize`` fails or hangs is followed by the next one. A reload
may give a model another tokenizer: the new one loads in a thread before it replaces
the old, so no request waits for it (``load`` then ``use_settings``).

Models with a local tokenizer are the operator's (its settings name them), and each
keeps its own caches. Any other model a pod serves is tokenized by the pods, and the
pods choose those models: their answers share one cache, and at most
``MAX_ENGINE_MODELS`` of them are kept, so memory does not grow with what pods announce.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from array import array
from collections.abc import Callable, Iterable, Sequence

import httpx
import xxhash

from gateway.config import ModelSettings, Settings
from gateway.openai_body import ParsedRequest
from gateway.pods import Pod
from kvindex.lru import BoundedLRU
from kvindex.tokenization.anthropic import messages_prompt
from kvindex.tokenization.engine import EngineTokenizer
from kvindex.tokenization.errors import UnsupportedPrompt
from kvindex.tokenization.front import (
    DEFAULT_CACHE_TOKENS,
    ENTRY_TOKENS,
    TokenCache,
    Tokenization,
    TokenizationError,
)
from kvindex.tokenization.local import LocalTokenizer
from kvindex.tokenization.prompt import ChatPrompt, lax_flag
from kvindex.tokenization.responses import responses_prompt
from kvindex.types import Bound

log = logging.getLogger("kvgate.kv")

# (model, tokenizer fingerprint, the prefix's cache key, its ids): a new prefix, told
SharePrefix = Callable[[str, bytes, bytes, "array[int]"], None]

TOKENIZE_ATTEMPTS = 2  # pods asked for /tokenize before routing by load alone
# Tokenizations kept of models without a local tokenizer. One is a few hundred bytes
# (what the pods answered is in the shared cache), and one that falls out is made again
# on its model's next request without loading anything.
MAX_ENGINE_MODELS = 4096
ENGINE_TOKENIZATION_BYTES = 600  # a Tokenization, its stats and policy objects (tracemalloc)


class PromptTokens:
    """Per model, how prompts become token ids; per pod, its ``/tokenize`` client."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient) -> None:
        self._s = settings
        self._client = client
        self._local: dict[str, Tokenization] = {}  # models with a local tokenizer
        self._by_engine: BoundedLRU[str, Tokenization] = BoundedLRU(MAX_ENGINE_MODELS)
        self._engine_cache = TokenCache(DEFAULT_CACHE_TOKENS, ENTRY_TOKENS)
        self._engines: dict[str, EngineTokenizer] = {}
        self._rotation = 0
        self._on_prefix: SharePrefix | None = None

    def share_prefixes(self, publish: SharePrefix) -> None:
        """Give ``publish`` (model, tokenizer fingerprint, key, ids) each prompt prefix
        a local tokenizer newly keeps; ``learn_prefix`` takes another process's (the
        sibling workers')."""
        self._on_prefix = publish
        for model, tok in self._local.items():
            self._hook(model, tok)

    def learn_prefix(self, model: str, fingerprint: bytes, key: bytes, ids: array[int]) -> bool:
        """Keep a prefix of ``model``'s that another process encoded; False if this
        process has no local tokenizer of it loaded (nothing is built for it here) or
        another one than the sender's (a reload reached one process first: ids of the
        old tokenizer would stand in the new one's cache for a text it encodes
        otherwise)."""
        tok = self._local.get(model)
        if tok is None or fingerprint != tokenizer_fingerprint(self._s, model):
            return False
        return tok.learn_prefix(key, ids)

    def _hook(self, model: str, tok: Tokenization) -> None:
        publish = self._on_prefix
        if publish is not None:
            fingerprint = tokenizer_fingerprint(self._s, model)
            tok.on_prefix = lambda key, ids: publish(model, fingerprint, key, ids)

    def tokenization(self, model: str) -> Tokenization:
        tok = self._local.get(model) or self._by_engine.touch(model)
        if tok is None:
            ms = self._s.models.get(model) or ModelSettings()
            self._keep(model, tok := build_tokenization(model, ms, self._engine_cache))
        return tok

    def _keep(self, model: str, tok: Tokenization) -> None:
        if tok.local is not None:
            self._local[model] = tok
            self._hook(model, tok)
        else:
            self._by_engine.put(model, tok)

    def _kept(self, model: str) -> bool:
        return model in self._local or model in self._by_engine

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
            if model not in warm and not self._kept(model):
                continue  # built on first use
            ms = settings.models.get(model) or ModelSettings()
            try:
                fresh[model] = await asyncio.to_thread(
                    _loaded_tokenization, model, ms, self._engine_cache
                )
            except Exception as exc:  # noqa: BLE001  (as at start-up: logged, falls back)
                log.warning("tokenizer for %s did not load: %r", model, exc)
        return fresh

    def use_settings(self, settings: Settings, loaded: dict[str, Tokenization]) -> None:
        """Take new settings with the tokenizations ``load`` made for them."""
        changed = self._changes(settings)
        self._s = settings
        for model in changed:
            self._local.pop(model, None)
            self._by_engine.pop(model)
        for model, tok in loaded.items():
            self._keep(model, tok)
        self._engines.clear()  # a pod's key or timeouts.tokenize_s may have changed

    def _changes(self, settings: Settings) -> list[str]:
        """Models whose tokenizer settings differ between the running and ``settings``."""
        old = self._s
        models = set(old.models) | set(settings.models) | set(self._local) | set(self._by_engine)
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
        out = {f"token_cache[{m}]": tok.cache.bound() for m, tok in self._local.items()}
        for m, tok in self._local.items():
            words = tok.incremental.segmenter.words if tok.incremental is not None else None
            if words is not None:
                out[f"word_cache[{m}]"] = words.bound()
        out["token_cache[by engine]"] = self._engine_cache.bound()
        out["engine_tokenizations"] = Bound(
            len(self._by_engine), MAX_ENGINE_MODELS, "models", ENGINE_TOKENIZATION_BYTES
        )
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
            add_special = lax_flag(body, "add_special_tokens", True)
            return await tok.completion(prompt, add_special_tokens=add_special, engine=engine)
        return None  # batched prompts are not routed by cache


def build_tokenization(
    model: str, ms: ModelSettings, engine_cache: TokenCache | None = None
) -> Tokenization:
    """How ``model``'s prompts become token ids: locally (its tokenizer files) or by a
    pod's ``/tokenize``, whose answers go to ``engine_cache`` when given (shared by the
    models without a local tokenizer). Loading a local tokenizer takes a second or two:
    callers on the event loop build it in a thread (``warm_up``) or on first use."""
    local = LocalTokenizer(ms.tokenizer) if ms.tokenizer and ms.tokenizer_mode != "engine" else None
    if local is not None:
        return Tokenization(model, mode=ms.tokenizer_mode, local=local)
    return Tokenization(model, mode="engine", cache=engine_cache)


def _warm_tokenizer(tok: Tokenization) -> Tokenization:
    local = tok.local
    if local is None:
        return tok
    local.encode("warm up", add_special_tokens=False)
    with contextlib.suppress(UnsupportedPrompt):  # a model without a chat template
        local.render_chat(ChatPrompt([{"role": "user", "content": "warm up"}]))
    local.anthropic_facts  # noqa: B018  (probes the template, a few renders)
    return tok


def _loaded_tokenization(model: str, ms: ModelSettings, engine_cache: TokenCache) -> Tokenization:
    return _warm_tokenizer(build_tokenization(model, ms, engine_cache))


def tokenizer_fingerprint(settings: Settings, model: str) -> bytes:
    """8 bytes naming the tokenizer ``settings`` give ``model`` (what a reload compares):
    the same in every process with the same settings."""
    return xxhash.xxh64_digest(repr(_tokenizer_of(settings, model)).encode())


def _tokenizer_of(settings: Settings, model: str) -> tuple[str | None, str]:
    ms = settings.models.get(model) or ModelSettings()
    return ms.tokenizer, ms.tokenizer_mode
