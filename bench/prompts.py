"""Prompt text of a chosen token length under the pods' tokenizer."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

_WORDS = (
    "cache prefix block token router gateway replica request latency prefill decode "
    "memory tier shared storage model system prompt document question answer user "
    "session history fleet pod queue load balance event index hash key value"
).split()


@lru_cache(maxsize=4)
def _tokenizer(path: str):  # noqa: ANN202 - tokenizers.Tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def text_of_tokens(n_tokens: int, seed: int, tokenizer_dir: Path) -> str:
    """Seeded text whose token count is n_tokens (±a few) under the tokenizer."""
    tok = _tokenizer(str(tokenizer_dir))
    rng = random.Random(seed)
    words: list[str] = []
    count = 0
    while count < n_tokens:
        chunk = [rng.choice(_WORDS) for _ in range(max(8, (n_tokens - count) // 2))]
        words.extend(chunk)
        count = len(tok.encode(" ".join(words), add_special_tokens=False).ids)
    while words and count > n_tokens:
        words.pop()
        count = len(tok.encode(" ".join(words), add_special_tokens=False).ids)
    return " ".join(words)
