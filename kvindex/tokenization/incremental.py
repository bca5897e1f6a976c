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

A prompt that extends an earlier one (a conversation's next turn) would still be cut,
hashed and assembled whole, which grows with every turn. So ``finish`` also keeps the
ids of the text up to its last added token (a chat template's last role marker),
under the hash of that text, and ``plan`` looks for the longest such prefix among the
last ``MAX_PREFIX_PROBES`` added-token ends of a new text: found, only the text after
it is cut and looked up. ``Segmenter.added_ends`` says why the segments before such a
point, in both texts, are the same; the entries share the segment cache's bound.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterator, Sequence
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

# Added-token ends of a new text tried, latest first, as the end of a known prefix: a
# conversation's new turns (an answer and a question) bring a few role markers each.
MAX_PREFIX_PROBES = 8
_PREFIX_TAG = b"prefix\0"


def _prefix_key(text: str, end: int) -> bytes:
    return xxhash.xxh3_128_digest(_PREFIX_TAG + text[:end].encode("utf-8", "surrogatepass"))


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
    prefix_tokens: int = 0  # of ``reused_tokens``, from a known prefix (one part)
    # Where to keep this text's prefix up to its last added token: the cache key and
    # how many leading ``parts`` cover it (None: nothing new to keep).
    prefix_key: bytes | None = None
    prefix_parts: int = 0
    prefix_ids: array[int] | None = None  # what ``finish`` kept under ``prefix_key``

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
        start = self._known_prefix(text, plan)
        for seg in self.segmenter.segments(text, start):
            if seg.text is None:
                plan.parts.append(seg.token)
                plan.prefix_parts = len(plan.parts)
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

    def _known_prefix(self, text: str, plan: Plan) -> int:
        """Where the longest cached prefix of ``text`` ending at an added token ends (0:
        none); its ids become the plan's first part."""
        ends = self.segmenter.added_ends(text)
        if not ends:
            return 0
        plan.prefix_key = _prefix_key(text, ends[-1])
        for end in reversed(ends[-MAX_PREFIX_PROBES:]):
            key = plan.prefix_key if end == ends[-1] else _prefix_key(text, end)
            ids = self.cache.get_array(key)
            if ids is not None:
                if end == ends[-1]:
                    plan.prefix_key = None  # kept already
                plan.parts.append(ids)
                plan.prefix_tokens = len(ids)
                plan.reused_tokens += len(ids)
                return end
        return 0

    def encode(self, plan: Plan) -> list[list[int]]:
        """Ids of the plan's missing segments (CPU work, safe in a worker thread)."""
        return self.segmenter.encode(plan.missing, plan.head_first)

    def finish(self, plan: Plan, encoded: Sequence[Sequence[int]]) -> array[int]:
        """Cache what ``encode`` returned for ``plan`` and give the text's ids (an
        ``array("I")``: the block keyer packs it as it is, and a list of 2,000 ids
        would cost more to build than all of this assembly)."""
        fresh = iter(encoded)
        keys = iter(plan.keys)
        out = array("I", plan.around[0])
        if plan.prefix_key is None:
            self._assemble(plan.parts, fresh, keys, out)
        else:
            self._assemble(plan.parts[: plan.prefix_parts], fresh, keys, out)
            plan.prefix_ids = out[len(plan.around[0]) :]
            self.cache.put_array(plan.prefix_key, plan.prefix_ids)
            self._assemble(plan.parts[plan.prefix_parts :], fresh, keys, out)
        out.extend(plan.around[1])
        return out

    def _assemble(
        self,
        parts: Sequence[array[int] | int | None],
        fresh: Iterator[Sequence[int]],
        keys: Iterator[bytes],
        out: array[int],
    ) -> None:
        """Append ``parts``' ids to ``out``, caching each fresh segment's."""
        put = self.cache.put_array
        for part in parts:
            if part is None:
                part = array("I", next(fresh))
                put(next(keys), part)
                out.extend(part)
            elif isinstance(part, int):
                out.append(part)
            else:
                out.extend(part)
