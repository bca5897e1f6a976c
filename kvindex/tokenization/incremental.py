"""Token ids assembled from ids cached per segment: a prompt costs only its new parts.

A conversation's earlier turns, a system prompt, a RAG document: ``Segmenter`` cuts
a rendered prompt into segments whose ids concatenate to the whole prompt's ids
(``kvindex.tokenization.segments`` says why that holds), each segment's ids are
cached under a 128-bit hash of its text (never the text), and only the segments the
cache lacks are encoded. A request runs in three steps so that the CPU-heavy one can
leave the event loop while the cache is only touched on it:

1. ``plan`` (event loop): cut the text, hash the segments, look them up;
2. ``encode`` (any thread; the Rust tokenizer drops the GIL): the missing segments;
3. ``finish`` (event loop): cache them, concatenate everything.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import xxhash

from kvindex.tokenization.segments import (
    DEFAULT_CHUNK_CHARS,
    Encode,
    NotSegmentable,
    Segmenter,
)

log = logging.getLogger("kvgate.tokenization")


class SegmentCache(Protocol):
    def get_array(self, key: bytes) -> array[int] | None: ...

    def put_array(self, key: bytes, ids: array[int]) -> None: ...


@dataclass(slots=True)
class Plan:
    """One text's segments: ``parts`` holds cached ids, added-token ids, and None
    where ``missing`` (in the same order) must be encoded."""

    parts: list[array[int] | int | None] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # of the missing segments
    head_first: bool = False  # missing[0] starts the text (Segmenter.encode)
    around: tuple[Sequence[int], Sequence[int]] = ((), ())  # add_special_tokens' ids
    reused_tokens: int = 0

    @property
    def missing_chars(self) -> int:
        return sum(map(len, self.missing))


class IncrementalEncoder:
    """Encodes texts for one tokenizer through a cache of segment ids."""

    def __init__(self, segmenter: Segmenter, cache: SegmentCache) -> None:
        self.segmenter = segmenter
        self.cache = cache

    @classmethod
    def for_backend(
        cls,
        backend: object,
        cache: SegmentCache,
        reference: Encode | None = None,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
    ) -> IncrementalEncoder | None:
        """None, logged, when ``backend`` (a ``tokenizers.Tokenizer``) cannot be segmented
        (``reference``: the encoder whose ids must come out, e.g. the transformers call)."""
        if backend is None:
            return None
        try:
            return cls(Segmenter.for_tokenizer(backend, chunk_chars, reference), cache)
        except NotSegmentable as exc:
            log.info("tokenizer not segmented, whole prompts are encoded: %s", exc)
            return None

    def handles(self, add_special_tokens: bool) -> bool:
        return not add_special_tokens or self.segmenter.around is not None

    def plan(self, text: str, add_special_tokens: bool) -> Plan:
        plan = Plan()
        if add_special_tokens:
            assert self.segmenter.around is not None
            plan.around = self.segmenter.around
        get = self.cache.get_array
        for seg in self.segmenter.segments(text):
            if seg.text is None:
                plan.parts.append(seg.token)
                continue
            tag = b"seg-head\0" if seg.head else b"seg\0"
            key = xxhash.xxh3_128_digest(tag + seg.text.encode("utf-8", "surrogatepass"))
            ids = get(key)
            if ids is None:
                if not plan.missing:
                    plan.head_first = seg.head
                plan.missing.append(seg.text)
                plan.keys.append(key)
            else:
                plan.reused_tokens += len(ids)
            plan.parts.append(ids)
        return plan

    def encode(self, plan: Plan) -> list[list[int]]:
        """Ids of the plan's missing segments (CPU work, safe in a worker thread)."""
        return self.segmenter.encode(plan.missing, plan.head_first)

    def finish(self, plan: Plan, encoded: Sequence[Sequence[int]]) -> list[int]:
        """Cache what ``encode`` returned for ``plan`` and give the text's ids."""
        fresh = iter(encoded)
        put = self.cache.put_array
        keys = iter(plan.keys)
        out = array("I", plan.around[0])
        for part in plan.parts:
            if part is None:
                part = array("I", next(fresh))
                put(next(keys), part)
                out.extend(part)
            elif isinstance(part, int):
                out.append(part)
            else:
                out.extend(part)
        out.extend(plan.around[1])
        return out.tolist()
