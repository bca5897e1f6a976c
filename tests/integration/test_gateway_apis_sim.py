"""kv-aware routing of Responses, Anthropic Messages and LoRA-adapter requests through
the gateway, fed by simulated pods' KV events: the gateway's predicted cached tokens
equal what the pod then reports, requests follow the cache, and an adapter's cache
never counts as the base model's (nor the other way round)."""

from __future__ import annotations

import httpx
import pytest

from bench.polling import wait_for
from bench.prompts import text_of_tokens
from bench.tinymodel import MODEL_NAME as MODEL
from bench.tinymodel import ensure_tokenizer
from tests.api_sequences import (
    assert_follows_the_cache,
    chat_once,
    messages_sequence,
    responses_sequence,
)
from tests.sim_gateway import model_env, sim_pods_and_gateway


@pytest.fixture(scope="module")
def gateway():
    env = model_env(KVGATE_EXPOSE_PREDICTIONS="true")
    with sim_pods_and_gateway(2, "kv-aware", env, lora_modules=("sql-lora",)) as (_, gw):
        yield gw


@pytest.fixture(scope="module")
def system_prompt() -> str:
    return text_of_tokens(600, seed=11, tokenizer_dir=ensure_tokenizer())


def test_responses_follow_their_cache_and_predict_cached_tokens_exactly(gateway, system_prompt):
    assert_follows_the_cache(responses_sequence(gateway, MODEL, system_prompt), 550)


def test_messages_follow_their_cache_and_predict_cached_tokens_exactly(gateway, system_prompt):
    seen = messages_sequence(gateway, MODEL, "anthropic " + system_prompt)
    assert_follows_the_cache(seen, 550)


def test_an_adapters_cache_is_its_own(gateway, system_prompt):
    """The same prompt under the base model and an adapter: each side's first request
    finds nothing cached, by the gateway's prediction and by the pod's count."""
    messages = [{"role": "system", "content": "lora " + system_prompt},
                {"role": "user", "content": "which tables?"}]  # fmt: skip

    def ask(model: str) -> tuple[str, int, int]:
        return chat_once(gateway, model, messages)

    base_first = ask(MODEL)
    wait_for(lambda: _held(gateway, MODEL, messages), 5, "the base model's blocks indexed")
    adapter_first = ask("sql-lora")
    wait_for(lambda: _held(gateway, "sql-lora", messages), 5, "the adapter's blocks indexed")
    adapter_again, base_again = ask("sql-lora"), ask(MODEL)
    assert (base_first[1:], adapter_first[1:]) == ((0, 0), (0, 0))
    for _pod, predicted, cached in (adapter_again, base_again):
        assert predicted == cached >= 550
    assert adapter_again[0] == adapter_first[0] and base_again[0] == base_first[0]


def _held(gateway, model: str, messages: list[dict]) -> bool:
    body = {"model": model, "messages": messages}
    r = httpx.post(f"{gateway.admin}/admin/index/lookup", json=body)
    assert r.status_code == 200, r.text
    return any(p["l0_blocks"] > 0 for p in r.json()["pods"].values())
