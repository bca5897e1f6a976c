"""What the gateway keeps per model it tokenizes and keys: the pods choose those models
(every card of every pod), so what each one costs is bounded by one shared budget."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from bench.tinymodel import ensure_tokenizer
from gateway import kv, prompt_tokens
from gateway.config import Settings
from gateway.kv import KvIndex
from gateway.prompt_tokens import PromptTokens


@pytest.fixture
async def client():
    async with httpx.AsyncClient() as c:
        yield c


async def test_models_the_pods_announce_share_one_token_cache_in_a_bounded_map(monkeypatch, client):
    monkeypatch.setattr(prompt_tokens, "MAX_ENGINE_MODELS", 8)
    tokens = PromptTokens(Settings(), client)
    made = [tokens.tokenization(f"announced-{i}") for i in range(50)]
    assert all(t.mode == "engine" and t.cache is made[0].cache for t in made)
    bounds = tokens.bounds()
    assert bounds["engine_tokenizations"].size == 8
    assert [name for name in bounds if name.startswith("token_cache")] == ["token_cache[by engine]"]
    assert tokens.tokenization("announced-49") is made[-1]  # the recent ones are kept


async def test_a_configured_local_tokenizer_is_never_pushed_out(monkeypatch, client):
    """Loading a local tokenizer takes a second or two: the operator's are kept, however
    many models the pods announce."""
    monkeypatch.setattr(prompt_tokens, "MAX_ENGINE_MODELS", 2)
    settings = Settings(models={"tiny": {"tokenizer": str(ensure_tokenizer())}})
    tokens = PromptTokens(settings, client)
    tiny = tokens.tokenization("tiny")
    assert tiny.local is not None
    for i in range(10):
        tokens.tokenization(f"announced-{i}")
    assert tokens.tokenization("tiny") is tiny
    assert {"token_cache[tiny]", "word_cache[tiny]"} <= set(tokens.bounds())


async def test_keyers_of_announced_models_share_their_caches_in_a_bounded_map(monkeypatch, client):
    monkeypatch.setattr(kv, "MAX_KEYERS", 8)
    index = KvIndex(Settings(), CollectorRegistry(), client)
    keyers = [index.keyer(f"announced-{i}") for i in range(50)]
    assert all(k.caches is keyers[0].caches for k in keyers)
    tokens = list(range(64 * 16))  # four groups: remembered as a head
    assert keyers[0].keys(tokens) != keyers[1].keys(tokens)  # another model's root
    bounds = index.bounds()
    assert bounds["keyers"].size == 8
    assert bounds["keyer_heads"].size == 2 * 64  # one head per model
    assert not any(name.startswith("keyer_roots[") for name in bounds)
    await index.close()
