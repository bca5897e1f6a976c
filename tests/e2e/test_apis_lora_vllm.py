"""Responses, Anthropic Messages and LoRA adapters through kvgate, against real vLLM.

Three pods: the session's two (base model only) and ``lora_pod`` (the base model plus
LoRA adapters made by ``bench.tinylora``). The gateway routes kv-aware with the pods'
own tokenizer and learns what each holds from their KV events. It must render a
Responses or Messages request to the token ids vLLM renders it to, predict exactly
the cached tokens vLLM then reports, send an adapter's requests only to the pod
serving it, follow adapters loaded and unloaded at runtime, and never count an
adapter's cache as the base model's or the other way round.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from bench.gateway_proc import GatewayURL, run_gateway
from bench.polling import wait_for
from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME, VllmServer
from kvindex.keyer import BlockKeyer
from tests.api_sequences import (
    assert_follows_the_cache,
    chat_once,
    messages_sequence,
    responses_sequence,
)
from tests.e2e.conftest import LORA_ADAPTER
from tests.e2e.prompts import prompt_text


@pytest.fixture(scope="module")
def gateway(lora_pod_starting, vllm_pods, lora_pod, tiny_tokenizer_dir) -> Iterator[GatewayURL]:
    names = ("pod-a", "pod-b", "pod-lora")
    pods = [(name, f"{p.url},events={p.events_endpoint},replay={p.replay_endpoint}")
            for name, p in zip(names, [*vllm_pods, lora_pod], strict=True)]  # fmt: skip
    models = {MODEL_NAME: {"block_size": BLOCK_SIZE, "tokenizer": str(tiny_tokenizer_dir)}}
    env = {"KVGATE_MODELS": json.dumps(models), "KVGATE_EXPOSE_PREDICTIONS": "true"}
    with run_gateway(pods, "kv-aware", env=env) as url:
        yield url


def _lookup(gateway: GatewayURL, body: dict) -> dict:
    r = httpx.post(f"{gateway.admin}/admin/index/lookup", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    ("api", "body"),
    [
        ("responses", {"instructions": "Answer briefly.",
                       "input": [{"role": "user", "content": [
                           {"type": "input_text", "text": "first part"},
                           {"type": "input_text", "text": "second part"}]},
                           {"type": "function_call", "call_id": "c1", "name": "f",
                            "arguments": "{}"},
                           {"type": "function_call_output", "call_id": "c1", "output": "42"}]}),
        ("messages", {"system": [{"type": "text", "text": "Answer briefly."}],
                      "max_tokens": 8,
                      "messages": [{"role": "user", "content": "hello"},
                                   {"role": "assistant", "content": [
                                       {"type": "text", "text": "calling"},
                                       {"type": "tool_use", "id": "t1", "name": "f",
                                        "input": {"x": 1}}]},
                                   {"role": "user", "content": [
                                       {"type": "tool_result", "tool_use_id": "t1",
                                        "content": "42"}]}]}),
    ],
)  # fmt: skip
def test_the_gateway_keys_the_token_ids_vllm_renders(gateway, lora_pod, nonce, api, body):
    """vLLM's own render endpoint (``/v1/<api>/render``) against the gateway's keys."""
    unique = prompt_text(nonce, 80)  # a first block no earlier test cached
    if api == "responses":
        body = {"model": MODEL_NAME, **body, "instructions": unique}
    else:
        body = {"model": MODEL_NAME, **body, "system": [{"type": "text", "text": unique}]}
    rendered = httpx.post(f"{lora_pod.url}/v1/{api}/render", json=body, timeout=30)
    assert rendered.status_code == 200, rendered.text
    ids = rendered.json()["token_ids"]
    seen = _lookup(gateway, {**body, "api": api})
    assert seen["prompt_tokens"] == len(ids)
    expected = BlockKeyer(MODEL_NAME, BLOCK_SIZE).keys(ids)
    assert [int(k, 16) for k in seen["keys"]] == expected


def test_responses_follow_the_cache_and_predict_vllms_cached_tokens(gateway, nonce):
    seen = responses_sequence(gateway, MODEL_NAME, prompt_text(nonce, 300))
    assert_follows_the_cache(seen, 250)


def test_messages_follow_the_cache_and_predict_vllms_cached_tokens(gateway, nonce):
    seen = messages_sequence(gateway, MODEL_NAME, prompt_text(nonce, 300))
    assert_follows_the_cache(seen, 250)


def test_an_adapter_is_routed_to_its_pod_with_its_own_cache(gateway, nonce):
    messages = [{"role": "system", "content": prompt_text(nonce, 300)},
                {"role": "user", "content": "which tables?"}]  # fmt: skip
    adapter = [chat_once(gateway, LORA_ADAPTER, messages) for _ in range(3)]
    assert [pod for pod, _, _ in adapter] == ["pod-lora"] * 3
    assert [(p, c) for _, p, c in adapter][0] == (0, 0)
    assert all(predicted == cached >= 250 for _, predicted, cached in adapter[1:]), adapter
    # The base model has nothing of this prompt, wherever it goes: not even on pod-lora.
    base = [chat_once(gateway, MODEL_NAME, messages) for _ in range(2)]
    assert base[0][1:] == (0, 0), base
    assert base[1][1] == base[1][2] >= 250, base
    # ... and the adapter's entry in the index is apart from the base model's.
    body = {"messages": messages, "add_generation_prompt": True}
    as_adapter = _lookup(gateway, {**body, "model": LORA_ADAPTER})
    as_base = _lookup(gateway, {**body, "model": MODEL_NAME})
    assert set(as_adapter["keys"]).isdisjoint(as_base["keys"])
    assert set(as_adapter["pods"]) == {"pod-lora"}


def test_adapters_loaded_and_unloaded_at_runtime_are_followed(
    gateway, lora_pod: VllmServer, lora_adapters, nonce
):
    messages = [{"role": "user", "content": prompt_text(nonce, 40)}]
    load = {"lora_name": "ops-lora", "lora_path": str(lora_adapters["ops-lora"])}
    r = httpx.post(f"{lora_pod.url}/v1/load_lora_adapter", json=load, timeout=60)
    assert r.status_code == 200, r.text
    assert chat_once(gateway, "ops-lora", messages)[0] == "pod-lora"  # no wait for a probe
    r = httpx.post(f"{lora_pod.url}/v1/unload_lora_adapter", json={"lora_name": "ops-lora"})
    assert r.status_code == 200, r.text

    def gone() -> dict | None:
        body = {"model": "ops-lora", "messages": messages, "max_tokens": 1}
        r = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=30)
        error = r.json().get("error") if r.status_code == 404 else None
        return error if error and error["code"] == "model_not_found" else None  # the gateway's

    error = wait_for(gone, 10, "the gateway to drop the unloaded adapter", poll=0.3)
    assert "ops-lora" in error["message"] and LORA_ADAPTER in error["message"]
