"""The gateway in front of two real vLLM pods, driven by the official openai client.

``bench.gateway_proc``:
``run_gateway(pods=[(name, url), ...], strategy="round-robin", extra_args=[])`` is a
context manager that starts ``kvgate serve`` and yields its base URL once ready.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from bench.gateway_proc import run_gateway
from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME, VllmServer
from tests.e2e.prompts import prompt_text

POD_NAMES = ("pod-0", "pod-1")


@pytest.fixture(scope="module")
def gateway(vllm_pods: list[VllmServer]) -> Iterator[str]:
    pods = [(name, pod.url) for name, pod in zip(POD_NAMES, vllm_pods, strict=True)]
    with run_gateway(pods, strategy="round-robin") as base_url:
        yield base_url


@pytest.fixture
def client(gateway: str) -> OpenAI:
    return OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0)


def chat_tokens(pod: VllmServer, messages: list[dict]) -> int:
    """Prompt length as the pod itself counts it (chat template applied)."""
    body = {"model": MODEL_NAME, "messages": messages}
    return httpx.post(f"{pod.url}/tokenize", json=body, timeout=30).json()["count"]


def test_chat_stream_through_gateway_delivers_content_and_usage(client, vllm_pods, nonce):
    messages = [{"role": "user", "content": prompt_text(nonce, 20)}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    content = [c.choices[0].delta.content for c in chunks if c.choices]
    assert len(content) >= 2 and "".join(x or "" for x in content) != ""
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == chat_tokens(vllm_pods[0], messages)


def test_round_robin_alternates_pods_as_shown_in_the_pod_header(client, nonce):
    seen = []
    for i in range(4):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": prompt_text(f"{nonce}{i}", 10)}],
            max_tokens=1,
        )
        raw.parse()
        seen.append(raw.headers["x-kvgate-pod"])
    assert set(seen) == set(POD_NAMES)
    assert seen[0] != seen[1] and seen[2] == seen[0] and seen[3] == seen[1]


def test_chat_without_stream_passes_usage_through(client, vllm_pods, nonce):
    messages = [{"role": "user", "content": prompt_text(nonce, 20)}]
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 3
    assert resp.usage.prompt_tokens == chat_tokens(vllm_pods[0], messages)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 3
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_completions_stream_and_non_stream_through_gateway(client, nonce):
    args = {"model": MODEL_NAME, "prompt": prompt_text(nonce, 20), "max_tokens": 4}
    args["extra_body"] = {"ignore_eos": True}
    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) != ""
    assert chunks[-1].usage.completion_tokens == 4
    whole = client.completions.create(**args)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 4
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_repeated_prompt_reports_cached_tokens_on_each_pods_second_visit(client, vllm_pods, nonce):
    messages = [{"role": "user", "content": prompt_text(nonce, 150)}]
    n = chat_tokens(vllm_pods[0], messages)
    cached_by_visit: dict[str, list[int]] = {}
    for _ in range(4):  # round-robin: A, B, A, B
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=messages, max_tokens=1
        )
        usage = raw.parse().usage
        assert usage.prompt_tokens == n
        pod = raw.headers["x-kvgate-pod"]
        cached_by_visit.setdefault(pod, []).append(usage.prompt_tokens_details.cached_tokens)
    hit = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert cached_by_visit == {name: [0, hit] for name in POD_NAMES}
