"""Ids of plain ASCII text from a cache of its words, for byte-level BPE tokenizers.

A byte-level BPE tokenizer (GPT-2's pre-tokenizer, or a ``Split`` on Llama 3's, Qwen
2's or Qwen 3.5's pattern before a byte-level map; no normaliser but NFC) cuts a text
into pre-tokens ("words") with its regex and runs BPE on each word alone: the ids of
a text are its words' ids, in order, and a word's ids never depend on its
neighbours. Text changes, words repeat: a conversation's new turn is mostly words
seen before. So the ids of a piece of text can be looked up word by word, with only
the words not seen before going to the Rust tokenizer, which was ~25% of the
gateway's CPU on a multi-turn workload (``bench/profile_gateway.sh kv-aware
multi-turn``): the whole piece cost ~130 µs a KB, its words from this cache ~35.

Only text whose words both regex engines cut alike is taken: ASCII without control
characters other than tab, newline and carriage return. There ``\\p{L}`` is
``[A-Za-z]``, ``\\p{N}`` ``[0-9]``, ``\\p{M}`` nothing and ``\\s`` ``[ \\t\\n\\r]`` in
Oniguruma (the tokenizer's engine) as in Python's ``re``, and each known pattern has
its ASCII spelling below. Anything else is encoded whole, as before.

Words are learnt from the whole piece's ids: a BPE token of ASCII text is as many
bytes as its vocabulary entry has characters, and tokens never cross a word's end,
so walking the ids along the words' lengths splits them. A walk that does not land
on a word's end would mean the two engines cut differently: it is counted and the
cache turns itself off. The cache is bounded (``capacity`` words, emptied when full).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import accumulate, chain
from typing import Any

from kvindex.tokenization.pretokenizers import (
    GPT2,
    LLAMA3,
    QWEN2,
    QWEN35,
    adds_prefix_space,
    byte_level_pattern,
)
from kvindex.types import Bound

DEFAULT_CAPACITY = 50_000  # words (24 MB at most, ~10 MB with typical words)
# A "word" is a run the pattern matches (letters, digits, punctuation, spaces) of any
# length the client sends: only words this short, and of this few ids, are remembered,
# or 50,000 words of a megabyte each would all stay. Others are encoded each time, as
# new words are (natural text's words are a few characters and one to three ids).
MAX_WORD_CHARS = 32
MAX_WORD_IDS = 8
# A remembered word at both limits, its ids' tuple and its dict slot: the worst case
# (tracemalloc, CPython 3.11: 479 B; a typical word ~200 B).
WORD_BYTES = 480

# A piece with more unknown words than this share goes to the tokenizer whole (one
# call there is cheaper than many one-word calls, ~3 µs each).
MAX_UNKNOWN_SHARE = 0.25

# Text that is mostly new words (ids, hashes, random strings) is not worth learning:
# past this moving average of the new words' share, one piece in EXPLORE_EVERY is.
NOVEL = 0.5
WARM_WORDS = 5_000  # words known before novelty is judged (all are new at first)
NOVELTY_WEIGHT = 0.1
EXPLORE_EVERY = 64

# The tokenizer's pattern -> its spelling for ASCII text (Python ``re``, ASCII mode).
_ASCII_PATTERNS = {
    GPT2: r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+",
    LLAMA3: (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}"
        r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    QWEN2: (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
        r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    QWEN35: (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
        r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
_NOT_A_WORD = 1 << 30  # the length given to ids that are not byte-level tokens
_UNSURE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # control characters
_PROBES = (
    "Hello world, it's 2024! Isn't it? We'LL see.\n\n  two  spaces\there\r\n",
    "def main():\n    return {'key': [1, 23, 4567]}  # comment\n",
    "a  b   c \n d\n\n\ne 'S 'd x'y 12345678 -- ...!? ~`^",
)

# Encodes pieces whole (the tokenizer's batch call): pieces -> their ids.
EncodeWhole = Callable[[Sequence[str]], list[list[int]]]


def ascii_pattern(cfg: dict[str, Any]) -> str | None:
    """The ASCII spelling of a byte-level BPE tokenizer's word pattern, or None when
    ``cfg`` (its tokenizer.json) is not a shape this module knows."""
    norm = cfg.get("normalizer")
    model = cfg.get("model") or {}
    if norm and norm.get("type") != "NFC" or model.get("type") != "BPE" or model.get("dropout"):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    pre = cfg.get("pre_tokenizer")
    if adds_prefix_space(pre):
        return None
    pattern = byte_level_pattern(pre)
    return None if pattern is None else _ASCII_PATTERNS[pattern]


class WordIds:
    """Word -> ids of one tokenizer, and the piece encoder that uses them."""

    def __init__(self, tokenizer: Any, pattern: str, capacity: int = DEFAULT_CAPACITY) -> None:
        self._tokenizer = tokenizer
        self._words = re.compile(pattern, re.ASCII)
        # a token's length in bytes: its vocabulary entry's characters (byte-level map)
        # (an added token is never inside a word: its length is none a word can have)
        vocab: dict[str, int] = tokenizer.get_vocab(with_added_tokens=False)
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._bytes = [_NOT_A_WORD] * max(size, max(vocab.values(), default=-1) + 1)
        for token, token_id in vocab.items():
            self._bytes[token_id] = len(token)
        self._ids: dict[str, tuple[int, ...]] = {}
        self.capacity = capacity
        self.enabled = True
        self._novelty = 0.0  # moving average of the share of new words in a piece
        self._passed = 0  # pieces encoded whole since the last one tried word by word
        self.misaligned = 0  # learning walks that missed a word's end (turns it off)
        self.from_words = 0  # pieces assembled from the cache (with a few new words)
        self.whole = 0  # eligible pieces encoded whole

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, cfg: dict[str, Any]) -> WordIds | None:
        """The cache for ``tokenizer`` if its shape is known and its probes agree."""
        pattern = ascii_pattern(cfg)
        if pattern is None:
            return None
        words = cls(tokenizer, pattern)

        def whole(pieces: Sequence[str]) -> list[list[int]]:
            return [e.ids for e in tokenizer.encode_batch(pieces, add_special_tokens=False)]

        for _ in range(2):  # learnt, then assembled from what was learnt
            if words.encode(_PROBES, whole) != whole(_PROBES) or not words.enabled:
                return None
        words._ids.clear()
        return words

    def __len__(self) -> int:
        return len(self._ids)

    def bound(self) -> Bound:
        return Bound(len(self._ids), self.capacity, "words", WORD_BYTES)

    def encode(self, pieces: Sequence[str], whole: EncodeWhole) -> list[list[int]]:
        """Ids of each piece: from the words where it can, ``whole`` for the rest."""
        out: list[list[int] | None] = []
        rest: list[tuple[int, list[str] | None]] = []  # for ``whole``: (index, words)
        for piece in pieces:
            words = self._words.findall(piece) if self._try(piece) else None
            ids = self._from_words(words) if words is not None else None
            if ids is None:
                rest.append((len(out), words))
            out.append(ids)
        if rest:
            encoded = whole([pieces[i] for i, _ in rest])
            for (i, words), ids in zip(rest, encoded, strict=True):
                out[i] = ids
                if words is not None and self.enabled:
                    self._learn(words, ids)
        return out  # type: ignore[return-value]  # every None was filled

    def _try(self, piece: str) -> bool:
        """Whether to look ``piece`` up word by word: plain text, and unless text has
        mostly been new words lately although many are known, then one piece in
        ``EXPLORE_EVERY`` (learning a piece's words costs about as much again as
        encoding it)."""
        if not self.enabled or not _plain(piece):
            return False
        if self._novelty > NOVEL and len(self._ids) >= WARM_WORDS and self._passed < EXPLORE_EVERY:
            self._passed += 1
            self.whole += 1
            return False
        self._passed = 0
        return True

    def _from_words(self, words: list[str]) -> list[int] | None:
        known = self._ids
        parts = list(map(known.get, words))
        new_share = parts.count(None) / len(words) if words else 0.0
        self._novelty += NOVELTY_WEIGHT * (new_share - self._novelty)
        if new_share:
            unknown = list({w for w, p in zip(words, parts, strict=True) if p is None})
            if len(unknown) > MAX_UNKNOWN_SHARE * len(words):
                self.whole += 1
                return None
            encoded = self._tokenizer.encode_batch_fast(unknown, add_special_tokens=False)
            fresh = {word: tuple(e.ids) for word, e in zip(unknown, encoded, strict=True)}
            for word, ids in fresh.items():
                self._remember(word, ids)
            parts = [p if p is not None else fresh[w] for w, p in zip(words, parts, strict=True)]
        self.from_words += 1
        return list(chain.from_iterable(parts))  # type: ignore[arg-type]

    def _learn(self, words: list[str], ids: Sequence[int]) -> None:
        """Split the ids of a piece encoded whole along its words, and keep them: the
        byte offset where each token ends, and where each word ends, must meet."""
        sizes = self._bytes
        try:
            ends = accumulate(map(sizes.__getitem__, ids))
            token_ends = dict(zip(ends, range(1, len(ids) + 1), strict=True))
        except IndexError:  # an id past the vocabulary: not a byte-level token
            token_ends = {}
        cuts = list(map(token_ends.get, accumulate(map(len, words))))
        if None in cuts or (cuts and cuts[-1] != len(ids)):
            self.misaligned += 1
            self.enabled = False  # the engines cut differently: never guess
            self._ids.clear()
            return
        known = self._ids
        for word, start, end in zip(words, [0, *cuts], cuts, strict=False):  # type: ignore[list-item]
            if word not in known:
                self._remember(word, tuple(ids[start:end]))

    def _remember(self, word: str, ids: tuple[int, ...]) -> None:
        if len(word) > MAX_WORD_CHARS or len(ids) > MAX_WORD_IDS:
            return
        if len(self._ids) >= self.capacity:
            self._ids.clear()
        self._ids[word] = ids


def _plain(piece: str) -> bool:
    return piece.isascii() and _UNSURE.search(piece) is None
