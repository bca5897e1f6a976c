"""kv-aware routing of Responses, Anthropic Messages and LoRA-adapter requests through
the gateway, fed by simulated pods' KV events: the gateway's predicted cached tokens
equal what the pod then reports, requests follow the cache, and an adapter's cache
never counts as the base model's (nor the other way round)."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from bench.polling import wait_for
from bench.prompts import text_of_tokens
from bench.tinymodel import MODEL_NAME as MODEL
from bench.tinymodel import ensure_tokenizer
from tests.sim_gateway import model_env, sim_pods_and_gateway

PREDICTED = "x-kvgate-predicted-cached-tokens"


@pytest.fixture(scope="module")
def gateway():
    env = model_env(KVGATE_EXPOSE_PREDICTIONS="true")
    with sim_pods_and_gateway(2, "kv-aware", env, lora_modules=("sql-lora",)) as (_, gw):
        yield gw


@pytest.fixture(scope="module")
def system_prompt() -> str:
    return text_of_tokens(600, seed=11, tokenizer_dir=ensure_tokenizer())


def test_responses_follow_their_cache_and_predict_cached_tokens_exactly(gateway, system_prompt):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0)
    seen = []
    for i in range(4):
        raw = client.responses.with_raw_response.create(
            model=MODEL, instructions=system_prompt, input=f"responses question {i}?",
            max_output_tokens=2, stream=i % 2 == 1,
        )  # fmt: skip
        if i % 2:  # streamed: the usage is in response.completed
            done = [e for e in raw.parse() if e.type == "response.completed"][0].response
        else:
            done = raw.parse()
        seen.append((raw.headers["x-kvgate-pod"], int(raw.headers[PREDICTED]),
                     done.usage.input_tokens_details.cached_tokens))  # fmt: skip
    assert len({pod for pod, _, _ in seen}) == 1, seen
    assert all(predicted == cached for _, predicted, cached in seen), seen
    assert all(cached >= 550 for _, _, cached in seen[1:]), seen


def test_messages_follow_their_cache_and_predict_cached_tokens_exactly(gateway, system_prompt):
    client = anthropic.Anthropic(base_url=gateway, api_key="x", max_retries=0)
    system = "anthropic " + system_prompt
    seen = []
    for i in range(4):
        args = {"model": MODEL, "system": system, "max_tokens": 2,
                "messages": [{"role": "user", "content": f"messages question {i}?"}]}  # fmt: skip
        if i % 2:
            with client.messages.with_streaming_response.create(**args, stream=True) as raw:
                headers, lines = raw.headers, list(raw.iter_lines())
            delta = json.loads([line for line in lines if '"message_delta"' in line][0][6:])
            usage = delta["usage"]
        else:
            raw = client.messages.with_raw_response.create(**args)
            headers, usage = raw.headers, raw.parse().usage.model_dump()
        seen.append((headers["x-kvgate-pod"], int(headers[PREDICTED]),
                     usage["cache_read_input_tokens"]))  # fmt: skip
    assert len({pod for pod, _, _ in seen}) == 1, seen
    assert all(predicted == cached for _, predicted, cached in seen), seen
    assert all(cached >= 550 for _, _, cached in seen[1:]), seen


def test_an_adapters_cache_is_its_own(gateway, system_prompt):
    """The same prompt under the base model and an adapter: each side's first request
    finds nothing cached, by the gateway's prediction and by the pod's count."""
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0)
    messages = [{"role": "system", "content": "lora " + system_prompt},
                {"role": "user", "content": "which tables?"}]  # fmt: skip

    def ask(model: str) -> tuple[str, int, int]:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=2
        )
        cached = raw.parse().usage.prompt_tokens_details.cached_tokens
        return raw.headers["x-kvgate-pod"], int(raw.headers[PREDICTED]), cached

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
