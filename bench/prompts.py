"""Prompt text of a chosen token length under the pods' tokenizer, fast.

The tiny tokenizer is byte-level BPE with a whitespace-splitting pre-tokenizer, so
the tokens of ``" w1 w2 ... wn"`` are the concatenation of each ``" wi"``'s tokens.
Knowing each word's cost once, a text of exactly ``n`` tokens is a seeded pick
of words whose costs sum to ``n`` — no encode loop per prompt. Space-led blocks
also concatenate exactly, which is what trace replay needs: one cached block
text per hash id, joined, trimmed at a word boundary to the target length.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_WORDS = (
    "cache prefix block token router gateway replica request latency prefill decode "
    "memory tier shared storage model system prompt document question answer user "
    "session history fleet pod queue load balance event index hash key value "
    "the a of to and in is for on with that by as at from it this be are was or"
).split()


@lru_cache(maxsize=4)
def _tokenizer(path: str):  # noqa: ANN202 - tokenizers.Tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def count_tokens(text: str, tokenizer_dir: Path) -> int:
    """Tokens of ``text`` under the tokenizer (no special tokens)."""
    return len(_tokenizer(str(tokenizer_dir)).encode(text, add_special_tokens=False).ids)


@lru_cache(maxsize=4)
def _costs(path: str) -> tuple[tuple[str, int], ...]:
    """(" word", tokens) for every vocabulary word; the 1-token ones make any sum reachable."""
    tok = _tokenizer(path)
    costs = tuple((" " + w, len(tok.encode(" " + w, add_special_tokens=False).ids)) for w in _WORDS)
    if not any(c == 1 for _, c in costs):
        raise RuntimeError("tokenizer has no single-token word; cannot hit exact lengths")
    return costs


@dataclass(frozen=True, slots=True)
class TextBlock:
    """Space-led text with its word boundaries: ``ends[i]`` tokens after word i."""

    words: tuple[str, ...]
    ends: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.ends[-1] if self.ends else 0

    @property
    def text(self) -> str:
        return "".join(self.words)

    def head(self, n_tokens: int) -> str:
        """The longest word-aligned prefix of at most ``n_tokens`` tokens."""
        return "".join(self.words[: bisect.bisect_right(self.ends, n_tokens)])

    def exact_head(self, n_tokens: int, filler: str) -> str:
        """``head(n_tokens)`` padded with the 1-token ``filler`` to exactly ``n_tokens``."""
        i = bisect.bisect_right(self.ends, n_tokens)
        short = n_tokens - (self.ends[i - 1] if i else 0)
        return "".join(self.words[:i]) + filler * short


def _pick(n_tokens: int, rng: random.Random, costs: tuple[tuple[str, int], ...]) -> TextBlock:
    words: list[str] = []
    ends: list[int] = []
    total = 0
    while total < n_tokens:
        left = n_tokens - total
        word, cost = rng.choice(costs)
        if cost > left:
            word, cost = rng.choice([wc for wc in costs if wc[1] <= left])
        total += cost
        words.append(word)
        ends.append(total)
    return TextBlock(tuple(words), tuple(ends))


@lru_cache(maxsize=8192)
def token_block(n_tokens: int, seed: int | str, tokenizer_dir: Path) -> TextBlock:
    """A seeded space-led text of exactly ``n_tokens`` tokens; cached (bounded)."""
    return _pick(n_tokens, random.Random(seed), _costs(str(tokenizer_dir)))


def filler_word(tokenizer_dir: Path) -> str:
    """A space-led word of exactly one token (pads trimmed blocks)."""
    return next(w for w, c in _costs(str(tokenizer_dir)) if c == 1)


def text_of_tokens(n_tokens: int, seed: int | str, tokenizer_dir: Path) -> str:
    """Seeded text of ``n_tokens`` tokens (exact under the tiny tokenizer).

    The leading space is dropped so the text reads naturally; the first word is
    re-costed without its space by swapping it for a word of equal cost.
    """
    if n_tokens <= 0:
        return ""
    rng = random.Random(seed)
    costs = _costs(str(tokenizer_dir))
    block = _pick(n_tokens, rng, costs)
    same = _bare_by_cost(str(tokenizer_dir)).get(block.ends[0])
    first = rng.choice(same) if same else block.words[0].lstrip()
    return first + "".join(block.words[1:])


@lru_cache(maxsize=4)
def _bare_by_cost(path: str) -> dict[int, list[str]]:
    """Words without a leading space, grouped by their token cost."""
    tok = _tokenizer(path)
    out: dict[int, list[str]] = {}
    for w in _WORDS:
        out.setdefault(len(tok.encode(w, add_special_tokens=False).ids), []).append(w)
    return out
