"""Per-model tokenization front: local renderer, the engine's /tokenize, or both.

``mode``: ``local`` (offline tokenizer only), ``engine`` (ask a pod), ``auto`` (local
when it can reproduce the engine, the pod otherwise). Results are cached in a bounded
LRU keyed by 128-bit hashes: locally, of each *segment* of the rendered prompt
(``kvindex.tokenization.incremental``: a prompt costs only the segments earlier
prompts did not have; a tokenizer that cannot be segmented is cached by whole
prompt), and of the canonical request for the engine. Only hashes and token ids
are kept, never prompt text.

Encoding is CPU work (~0.25 µs per character on a 2-core VM for new words, a seventh of
that for words the word cache knows; the Rust tokenizer drops the GIL in
``encode_batch``, which the transformers call and the segmented path use, but not in
``Tokenizer.encode``). A segmented prompt's new text is encoded in a worker thread when
encoding it inline would hold the event loop too long (``offload.OffloadPolicy``, from
the measured cost per character; always above ``offload_max_chars``, never up to
``offload_chars``); a whole-prompt encode longer than ``offload_chars`` goes to a
thread, and so does a chat whose rendering costs as much (``render_cost_chars``).
"""

from __future__ import annotations

import asyncio
import json
import time
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import xxhash

from kvindex.lru import BoundedLRU
from kvindex.tokenization.engine import EngineTokenizeError, EngineTokenizer
from kvindex.tokenization.errors import UnsupportedPrompt
from kvindex.tokenization.incremental import IncrementalEncoder, Plan
from kvindex.tokenization.local import LocalTokenizer
from kvindex.tokenization.offload import DEFAULT_MAX_CHARS, DEFAULT_MIN_CHARS, OffloadPolicy
from kvindex.tokenization.prompt import ChatPrompt
from kvindex.types import Bound

Mode = Literal["local", "engine", "auto"]
DEFAULT_CACHE_TOKENS = 4_000_000  # ~16 MB of uint32 ids
TOKEN_BYTES = 4  # uint32 ids
# An entry's own memory (LRU node, 16-byte key, array header: ~200 B, tracemalloc) in
# tokens, counted against the capacity: a cache of short segments stays within it too.
ENTRY_TOKENS = 50
DEFAULT_OFFLOAD_CHARS = DEFAULT_MIN_CHARS  # ~0.5 ms of encoding new words


class TokenizationError(RuntimeError):
    """No tokenizer could produce ids for this request."""


@dataclass(slots=True)
class TokenizationStats:
    hits: int = 0
    misses: int = 0
    local: int = 0
    engine: int = 0
    fallbacks: int = 0  # auto mode: local could not, the engine did
    offloaded: int = 0
    encoded_chars: int = 0  # local: characters sent to the tokenizer
    reused_tokens: int = 0  # local: token ids taken from cached segments
    prefix_tokens: int = 0  # of those, from known prefixes (a conversation's earlier turns)


class TokenCache:
    """LRU of hash → token ids, bounded by the tokens held (each entry also counts
    ``entry_tokens`` for its own overhead)."""

    def __init__(self, capacity_tokens: int = DEFAULT_CACHE_TOKENS, entry_tokens: int = 0) -> None:
        self.capacity_tokens = capacity_tokens
        self.entry_tokens = entry_tokens
        # ids as uint32 arrays: 4 bytes a token, against ~36 in a list of ints
        self._lru: BoundedLRU[bytes, array[int]] = BoundedLRU(capacity_tokens, weigh=self._weigh)

    def _weigh(self, ids: array[int]) -> int:
        return len(ids) + self.entry_tokens

    @property
    def tokens(self) -> int:
        """Tokens held, in all entries, with each entry's overhead."""
        return self._lru.size

    def bound(self) -> Bound:
        return Bound(self.tokens, self.capacity_tokens, "tokens", TOKEN_BYTES)

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, key: bytes) -> list[int] | None:
        ids = self._lru.touch(key)
        return None if ids is None else ids.tolist()

    def put(self, key: bytes, ids: Sequence[int]) -> None:
        """Keep ``ids`` as most recent, unless they alone exceed the capacity."""
        self._lru.put(key, array("I", ids))

    def get_array(self, key: bytes) -> array[int] | None:
        """The ids as stored (not to be changed), now the most recent; None if absent."""
        return self._lru.touch(key)

    def put_array(self, key: bytes, ids: array[int]) -> None:
        self._lru.put(key, ids)


def _key(kind: bytes, text: str) -> bytes:
    return xxhash.xxh3_128_digest(kind + b"\0" + text.encode("utf-8", "surrogatepass"))


class Tokenization:
    """Token ids for one model's chat and completion prompts."""

    def __init__(
        self,
        model: str,
        mode: Mode = "auto",
        local: LocalTokenizer | None = None,
        engine: EngineTokenizer | None = None,
        cache_tokens: int = DEFAULT_CACHE_TOKENS,
        offload_chars: int = DEFAULT_OFFLOAD_CHARS,
        offload_max_chars: int = DEFAULT_MAX_CHARS,
        cache: TokenCache | None = None,
    ) -> None:
        """``cache``: one shared with other models' tokenizations (the engine's answers
        are keyed by model), instead of one of ``cache_tokens`` of its own."""
        if mode == "local" and local is None:
            raise ValueError("mode 'local' needs a LocalTokenizer")
        self.model = model
        self.mode: Mode = mode
        self.local = local if mode != "engine" else None
        self.engine = engine
        self.cache = cache if cache is not None else TokenCache(cache_tokens, ENTRY_TOKENS)
        self.offload = OffloadPolicy(offload_chars, offload_max_chars)
        self.stats = TokenizationStats()
        self.incremental = (
            IncrementalEncoder.for_backend(self.local.backend, self.cache, self.local.encode)
            if self.local is not None
            else None
        )
        # Told of the prefix newly kept of each chat that continues a conversation (its
        # cache key and ids): another process serving the same clients (``--workers N``)
        # keeps it too, so the next turn, sent on a connection the kernel gave that
        # process, is not encoded again from its start there. A first turn's is not
        # told: most prompts with no answer in them are never extended (a new question
        # on a shared system prompt), and what they share, the siblings' own segment
        # caches hold.
        self.on_prefix: Callable[[bytes, array[int]], None] | None = None

    def learn_prefix(self, key: bytes, ids: array[int]) -> bool:
        """Keep a prefix another process encoded (``on_prefix`` there); False if this
        tokenization keeps no prefixes (no local tokenizer, or one not segmented)."""
        if self.incremental is None:
            return False
        self.cache.put_array(key, ids)
        return True

    async def chat(
        self, prompt: ChatPrompt, *, engine: EngineTokenizer | None = None
    ) -> Sequence[int]:
        """Ids of a chat request as the engine will see them (a list, or an
        ``array("I")`` when assembled from cached segments)."""
        if self.local is not None:
            try:
                return await self._local_chat(prompt)
            except UnsupportedPrompt as exc:
                if self.mode == "local":
                    raise TokenizationError(str(exc)) from None
                self.stats.fallbacks += 1
        pod = self._engine(engine)
        return await self._via_engine(
            b"chat-engine", prompt.tokenize_body(), lambda: pod.chat(self.model, prompt)
        )

    async def completion(
        self, prompt: str, *, add_special_tokens: bool = True, engine: EngineTokenizer | None = None
    ) -> Sequence[int]:
        """Ids of a completion prompt (vLLM adds special tokens such as BOS by default)."""
        if self.local is not None:
            kind = b"cmpl+special" if add_special_tokens else b"cmpl"
            return await self._local_encode(kind, prompt, add_special_tokens)
        pod = self._engine(engine)
        request = {"prompt": prompt, "add_special_tokens": add_special_tokens}
        return await self._via_engine(
            b"cmpl-engine", request, lambda: pod.completion(self.model, prompt, add_special_tokens)
        )

    def _engine(self, engine: EngineTokenizer | None) -> EngineTokenizer:
        pod = engine if engine is not None else self.engine
        if pod is None:
            raise TokenizationError(f"no engine tokenizer for model {self.model}")
        return pod

    async def _local_chat(self, prompt: ChatPrompt) -> Sequence[int]:
        assert self.local is not None
        if render_cost_chars(prompt.messages) > self.offload.min_chars:
            text = await asyncio.to_thread(self.local.render_chat, prompt)
        else:
            text = self.local.render_chat(prompt)
        special = prompt.add_special_tokens
        kind = b"chat+special" if special else b"chat"
        return await self._local_encode(kind, text, special, _continues(prompt))

    async def _local_encode(
        self, kind: bytes, text: str, add_special_tokens: bool, continues: bool = False
    ) -> Sequence[int]:
        """``continues``: the text is a conversation with an answer in it already, whose
        next turn will extend it (its prefix goes to ``on_prefix``)."""
        assert self.local is not None
        inc = self.incremental
        if inc is not None and inc.handles(add_special_tokens):
            return await self._incremental(inc, text, add_special_tokens, continues)
        key = _key(kind, text)
        cached = self.cache.get(key)
        if cached is not None:
            self.stats.hits += 1
            return cached
        self.stats.misses += 1
        self.stats.local += 1
        self.stats.encoded_chars += len(text)
        if len(text) > self.offload.min_chars:
            self.stats.offloaded += 1
            ids = await asyncio.to_thread(self.local.encode, text, add_special_tokens)
        else:
            ids = self.local.encode(text, add_special_tokens)
        self.cache.put(key, ids)
        return ids

    async def _incremental(
        self, inc: IncrementalEncoder, text: str, add_special_tokens: bool, continues: bool
    ) -> Sequence[int]:
        """Only the segments no earlier prompt had are encoded, off the loop when long."""
        plan = inc.plan(text, add_special_tokens)
        self.stats.reused_tokens += plan.reused_tokens
        self.stats.prefix_tokens += plan.prefix_tokens
        if not plan.missing:
            self.stats.hits += 1
            return self._finish(inc, plan, [], continues)
        self.stats.misses += 1
        self.stats.local += 1
        chars = plan.missing_chars
        self.stats.encoded_chars += chars
        if self.offload.inline(chars):
            encoded, seconds = _encode_timed(inc, plan)
        else:
            self.stats.offloaded += 1
            encoded, seconds = await asyncio.to_thread(_encode_timed, inc, plan)
        self.offload.observe(chars, seconds)
        return self._finish(inc, plan, encoded, continues)

    def _finish(
        self, inc: IncrementalEncoder, plan: Plan, encoded: Sequence[Sequence[int]],
        continues: bool,
    ) -> array[int]:  # fmt: skip
        ids = inc.finish(plan, encoded)
        if continues and plan.prefix_ids is not None and self.on_prefix is not None:
            assert plan.prefix_key is not None
            self.on_prefix(plan.prefix_key, plan.prefix_ids)
        return ids

    async def _via_engine(
        self, kind: bytes, request: dict[str, Any], call: Callable[[], Awaitable[list[int]]]
    ) -> list[int]:
        # The model is in the key: another model's tokenization may share the cache.
        key = _key(kind, json.dumps([self.model, request], sort_keys=True, default=str))
        cached = self.cache.get(key)
        if cached is not None:
            self.stats.hits += 1
            return cached
        self.stats.misses += 1
        try:
            ids = await call()
        except EngineTokenizeError as exc:
            raise TokenizationError(str(exc)) from None
        self.stats.engine += 1
        self.cache.put(key, ids)
        return ids


def _continues(prompt: ChatPrompt) -> bool:
    """Whether the chat holds an earlier answer: a conversation past its first turn."""
    return any(isinstance(m, Mapping) and m.get("role") == "assistant" for m in prompt.messages)


def _encode_timed(inc: IncrementalEncoder, plan: Plan) -> tuple[list[list[int]], float]:
    """``inc.encode(plan)`` with the calling thread's CPU time for it, on the loop or in a
    worker thread alike: wall time would also count waiting for the GIL, or the loop
    being preempted on a busy host, and the estimate would follow the load, not the text."""
    started = time.thread_time()
    encoded = inc.encode(plan)
    return encoded, time.thread_time() - started


# Rendering costs ~4 µs a message (normalising it, one pass of the template's loop) and
# little a character (~20 µs for one message of 100k characters, 3 ms for 1M: copies),
# against ~0.25 µs a character to encode (tiny model's template, 2-core VM). In
# characters-to-encode, a message costs 20 and 50 characters of text cost one: 240k
# empty messages, or megabytes of text, move off the event loop; an 8 KB chat renders
# inline (~20 µs, against ~70 µs through a worker thread).
MESSAGE_COST_CHARS = 20
RENDER_CHARS_PER_CHAR = 50


def render_cost_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """Work to render ``messages``, in characters-to-encode: a fixed cost per message,
    so that many short messages move off the event loop too, and a little per character."""
    chars = 0
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(str(p.get("text", ""))) for p in content if isinstance(p, Mapping))
    return MESSAGE_COST_CHARS * len(messages) + chars // RENDER_CHARS_PER_CHAR
