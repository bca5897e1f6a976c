"""Cut a prompt into segments whose ids, encoded one by one, concatenate to the ids of
the whole prompt, so that ids cached per segment serve every later prompt that
shares the segment: a conversation's earlier turns, a RAG document.

Why it holds, for a Hugging Face fast tokenizer (``tokenizers``; checked against its
source, and by property tests on tokenizers shaped like GPT-2, Llama 2 and 3, Qwen 2
and BERT in ``tests/unit/test_tokenization_segments.py``):

1. **Added tokens.** ``Tokenizer.encode`` first cuts the text at its added tokens
   whose ``normalized`` is false (special or not; leftmost-longest on the raw
   text); each piece between them is then normalised, pre-tokenized and modelled
   on its own. So the ids of a text are the added tokens' ids and each piece's
   ids, in order, unless a step looks beyond its piece. Two do:

   * ``Metaspace(prepend_scheme="first")`` prepends "▁" only to the piece at offset
     0 of the whole text: a piece elsewhere is encoded by a copy of the tokenizer
     whose ``prepend_scheme`` is ``"never"``, and cache keys say which;
   * an added token with ``lstrip``, ``rstrip`` or ``single_word`` looks at its
     neighbours: such a tokenizer is not segmented (whole-text encoding).

   The post-processor adds the same ids around any single sequence (BOS, EOS,
   [CLS]/[SEP]): they are found at load by encoding probes with and without
   ``add_special_tokens``, and segmented encoding is checked on more probes,
   against the caller's reference encoder when it has one (the transformers call,
   in case it does more than the Rust tokenizer).
2. **Seams inside long pieces.** With GPT-2's byte-level pre-tokenizer, or a
   ``Split`` on Llama 3's, Qwen 2's or Qwen 3.5's pattern before a byte-level map,
   no normaliser or NFC, and a BPE model: every one of these patterns starts a
   pre-token at a space followed by a letter (the space is the optional first
   character of a word) and ends the word before it at that space exactly as at
   the end of the text, and BPE never merges across pre-tokens. So a piece can be
   cut before a space that has an ASCII letter on both sides (NFC never composes
   across an ASCII space or letter). Pieces longer than ``chunk_chars`` are cut at
   the first such seam after every ``chunk_chars`` characters: the cuts depend only
   on the text before them, so a document followed by different questions gives
   the same chunks up to its last one.

Any other tokenizer shape (another normaliser, pre-tokenizer or post-processor type,
BPE dropout, truncation or padding set, special tokens encoded as text) raises
``NotSegmentable`` at load, and the caller encodes whole texts as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvindex.tokenization.pretokenizers import byte_level_pattern
from kvindex.tokenization.words import WordIds

DEFAULT_CHUNK_CHARS = 1024  # ~400 tokens re-encoded at most where a long piece changes
BATCH_CHARS = 2048  # characters per encode call (~0.5 ms of work on one core)

# Types whose work stays inside the piece it is given (tokenizers 0.23).
_NORMALIZERS = frozenset(
    {"BertNormalizer", "ByteLevel", "Lowercase", "NFC", "NFD", "NFKC", "NFKD", "Nmt",
     "Precompiled", "Prepend", "Replace", "Sequence", "Strip", "StripAccents"}
)  # fmt: skip
_PRE_TOKENIZERS = frozenset(
    {"BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Digits", "Metaspace",
     "Punctuation", "Sequence", "Split", "UnicodeScripts", "Whitespace", "WhitespaceSplit"}
)  # fmt: skip
_POST_PROCESSORS = frozenset(
    {"BertProcessing", "ByteLevel", "RobertaProcessing", "Sequence", "TemplateProcessing"}
)
_MODELS = frozenset({"BPE", "Unigram", "WordLevel", "WordPiece"})

_SEAM = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")
_PROBES = ("a", "", "Hello world", " two  spaces\n", "é ü 字")
Encode = Callable[[str, bool], list[int]]  # text, add_special_tokens -> ids


class NotSegmentable(ValueError):
    """This tokenizer's ids are not the concatenation of its segments' ids."""


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of text to encode, or an added token (``text`` None, ``token`` its id).
    ``head``: the piece starts the whole text (it matters to ``Metaspace`` "first")."""

    text: str | None
    token: int = -1
    head: bool = False


class Segmenter:
    """Cuts texts for one tokenizer and encodes segments; build with ``for_tokenizer``."""

    def __init__(
        self,
        tokenizer: Any,  # tokenizers.Tokenizer
        elsewhere: Any,  # the same, for pieces not at offset 0 (Metaspace "first")
        added: dict[str, int],
        seams: bool,
        around: tuple[list[int], list[int]] | None,
        chunk_chars: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._elsewhere = elsewhere
        self._added = added
        ordered = sorted(added, key=len, reverse=True)  # leftmost, then longest
        self._added_re = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self.seams = seams
        self.around = around  # ids add_special_tokens puts before and after; None: unknown
        self.chunk_chars = chunk_chars
        self.head_matters = elsewhere is not tokenizer
        # plain ASCII pieces from a cache of their words (``words``); None: whole pieces
        self.words: WordIds | None = None

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Any,
        chunk_chars: int = DEFAULT_CHUNK_CHARS,
        reference: Encode | None = None,
    ) -> Segmenter:
        """Check ``tokenizer`` (a ``tokenizers.Tokenizer``) and build; ``NotSegmentable``
        says why not. ``reference``: the encoder whose ids must come out (default: the
        tokenizer's own ``encode``)."""
        if tokenizer.encode_special_tokens:
            raise NotSegmentable("special tokens are encoded as text")
        cfg = json.loads(tokenizer.to_str())
        if cfg.get("truncation") or cfg.get("padding"):
            raise NotSegmentable("truncation or padding is set")
        _check_types(cfg)
        added: dict[str, int] = {}
        has_normalized = False
        for tok in cfg.get("added_tokens") or ():
            if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
                raise NotSegmentable(f"added token {tok['content']!r} looks at its neighbours")
            if tok.get("normalized"):
                has_normalized = True  # matched inside pieces, after normalisation
            elif tok["content"]:
                added[tok["content"]] = tok["id"]
        elsewhere = tokenizer
        if _prepends_first(cfg["pre_tokenizer"]):
            elsewhere = type(tokenizer).from_str(json.dumps(_never_prepend(cfg)))
        seams = not has_normalized and _seam_safe(cfg)
        seg = cls(tokenizer, elsewhere, added, seams, None, chunk_chars)
        if seams and not seg.head_matters:
            seg.words = WordIds.for_tokenizer(tokenizer, cfg)
        reference = reference or (lambda t, s: tokenizer.encode(t, add_special_tokens=s).ids)
        seg.around = seg._find_around(reference)
        seg._check(reference, added)
        return seg

    def segments(self, text: str, start: int = 0) -> list[Segment]:
        """``text`` as added tokens and pieces (long pieces cut at seams), in order;
        from ``start`` on, which must be 0 or one of ``added_ends``: the segments of
        the text from there, the same as those of the whole text after that point."""
        out: list[Segment] = []
        if self._added_re is not None:
            added = self._added
            for m in self._added_re.finditer(text, start):
                if m.start() > start:
                    self._pieces(text[start : m.start()], start == 0, out)
                out.append(Segment(None, added[m.group()]))
                start = m.end()
        if start < len(text):
            self._pieces(text[start:], start == 0, out)
        return out

    def added_ends(self, text: str) -> list[int]:
        """Where each added token of ``text`` ends. If two texts share their characters
        up to ``p`` and ``p`` is in both texts' ``added_ends``, their segments before
        ``p`` are the same: added tokens are matched leftmost-longest from the start,
        so the matches of both texts agree until one of them takes a token that runs
        past ``p`` (a longer token, ``<a>`` against ``<a>b``), after which that text
        has no match ending at ``p``; and no piece spans an added token."""
        if self._added_re is None:
            return []
        return [m.end() for m in self._added_re.finditer(text)]

    def _pieces(self, piece: str, head: bool, out: list[Segment]) -> None:
        head = head and self.head_matters
        cut = self.chunk_chars
        if not self.seams or len(piece) <= cut:
            out.append(Segment(piece, head=head))
            return
        start = 0
        while len(piece) - start > cut and (m := _SEAM.search(piece, start + cut)) is not None:
            out.append(Segment(piece[start : m.start()], head=head and start == 0))
            start = m.start()
        out.append(Segment(piece[start:], head=head and start == 0))

    def encode(self, pieces: Sequence[str], head_first: bool = False) -> list[list[int]]:
        """Ids of each piece (no added tokens inside). ``head_first``: ``pieces[0]``
        starts the whole text. CPU work that drops the GIL (``encode_batch``)."""
        if not pieces:
            return []
        if self.words is not None:  # byte-level BPE: no head to mind
            return self.words.encode(pieces, lambda rest: self._batch(self._elsewhere, rest))
        if head_first and self.head_matters:
            return self._batch(self._tokenizer, pieces[:1]) + self._batch(
                self._elsewhere, pieces[1:]
            )
        return self._batch(self._elsewhere, pieces)

    @staticmethod
    def _batch(tokenizer: Any, pieces: Sequence[str]) -> list[list[int]]:
        """Encode in calls of about ``BATCH_CHARS`` characters: ``encode_batch`` spreads
        one call's pieces over every core (rayon), which would leave the event loop's
        thread waiting for a core for as long as a long prompt takes; small calls keep
        that to well under a millisecond, and the prompt to about one core."""
        batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets
        out: list[list[int]] = []
        group: list[str] = []
        chars = 0
        for piece in [*pieces, None]:
            if group and (piece is None or chars + len(piece) > BATCH_CHARS):
                out += [e.ids for e in batch(group, add_special_tokens=False)]
                group, chars = [], 0
            if piece is not None:
                group.append(piece)
                chars += len(piece)
        return out

    def encode_whole(self, text: str, add_special_tokens: bool) -> list[int]:
        """Ids of ``text`` assembled from its segments, uncached (the reference path
        the cache reproduces; tests and the cold path of small texts)."""
        segs = self.segments(text)
        pieces = [s.text for s in segs if s.text is not None]
        encoded = iter(self.encode(pieces, head_first=bool(segs) and segs[0].head))
        ids: list[int] = []
        for s in segs:
            ids.extend(next(encoded) if s.text is not None else [s.token])
        if add_special_tokens:
            if self.around is None:
                raise NotSegmentable("the post-processor's ids are not known")
            ids = [*self.around[0], *ids, *self.around[1]]
        return ids

    def _find_around(self, reference: Encode) -> tuple[list[int], list[int]] | None:
        """The ids ``add_special_tokens`` puts around a single sequence, if constant."""
        found: tuple[list[int], list[int]] | None = None
        for probe in _PROBES:
            bare, full = reference(probe, False), reference(probe, True)
            if found is None:
                found = _split_around(full, bare)
                if found is None:
                    return None
            elif full != [*found[0], *bare, *found[1]]:
                return None
        return found

    def _check(self, reference: Encode, added: dict[str, int]) -> None:
        """Segmented ids equal ``reference``'s on probes with added tokens and seams."""
        marks = list(added)[:3]
        probes = [*_PROBES, "".join(f"{m} a{i} b c{m}" for i, m in enumerate(marks)) + " d e"]
        for probe in probes:
            for special in (False, True) if self.around is not None else (False,):
                if self.encode_whole(probe, special) != reference(probe, special):
                    raise NotSegmentable("segmented ids differ from the tokenizer's on a probe")


def _split_around(full: list[int], bare: list[int]) -> tuple[list[int], list[int]] | None:
    for i in range(len(full) - len(bare) + 1):
        if full[i : i + len(bare)] == bare:
            return full[:i], full[i + len(bare) :]
    return None


def _types(node: Any, key: str) -> list[dict[str, Any]]:
    """``node`` and, for a ``Sequence``, its members (recursively)."""
    if not node:
        return []
    out = [node]
    for child in node.get(key) or ():
        out += _types(child, key)
    return out


def _check_types(cfg: dict[str, Any]) -> None:
    for part, key, known in (
        ("normalizer", "normalizers", _NORMALIZERS),
        ("pre_tokenizer", "pretokenizers", _PRE_TOKENIZERS),
        ("post_processor", "processors", _POST_PROCESSORS),
    ):
        for node in _types(cfg.get(part), key):
            if node.get("type") not in known:
                raise NotSegmentable(f"{part} {node.get('type')} is not known to stay in a piece")
    model = cfg.get("model") or {}
    if model.get("type") not in _MODELS:
        raise NotSegmentable(f"model {model.get('type')} is not known")
    if model.get("dropout"):
        raise NotSegmentable("BPE dropout makes encoding random")


def _prepends_first(pre: Any) -> bool:
    return any(
        n.get("type") == "Metaspace" and n.get("prepend_scheme") == "first"
        for n in _types(pre, "pretokenizers")
    )


def _never_prepend(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with every Metaspace's ``prepend_scheme`` "first" made "never"."""
    out = json.loads(json.dumps(cfg))
    for node in _types(out["pre_tokenizer"], "pretokenizers"):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            node["prepend_scheme"] = "never"
    return out


def _seam_safe(cfg: dict[str, Any]) -> bool:
    """A known byte-level BPE pre-tokenizer (``pretokenizers``: each of their patterns
    starts a pre-token at a space before a letter), no normaliser but NFC."""
    norm = cfg.get("normalizer")
    if norm and norm.get("type") != "NFC":
        return False
    if (cfg.get("model") or {}).get("type") != "BPE":
        return False
    return byte_level_pattern(cfg.get("pre_tokenizer")) is not None
