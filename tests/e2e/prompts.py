"""Prompts for the e2e tests: synthetic text, unique per test, about n words long."""

from __future__ import annotations

import random

_WORDS = (
    "cache block prefix token router gateway replica request latency memory tier "
    "engine event stream batch queue shared storage prompt model fleet host device "
    "copy load store evict hash chain parent child salt tenant"
).split()


def prompt_text(nonce: str, words: int = 300) -> str:
    """``nonce`` first (so the first block is new), then seeded filler words."""
    rng = random.Random(nonce)
    return nonce + " " + " ".join(rng.choice(_WORDS) for _ in range(words))
