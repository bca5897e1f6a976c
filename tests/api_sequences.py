"""Repeated Responses and Anthropic Messages requests through a gateway, as their official
clients send them, alternating whole answers and streams: for each, the pod that served
it, the cached tokens the gateway predicted, and those the pod then reported."""

from __future__ import annotations

import json

import anthropic
import openai

PREDICTED = "x-kvgate-predicted-cached-tokens"
Seen = list[tuple[str, int, int]]  # (pod, predicted cached tokens, reported cached tokens)


def responses_sequence(gateway: str, model: str, instructions: str, n: int = 4) -> Seen:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0)
    seen = []
    for i in range(n):
        raw = client.responses.with_raw_response.create(
            model=model, instructions=instructions, input=f"question {i}?",
            max_output_tokens=2, stream=i % 2 == 1,
        )  # fmt: skip
        parsed = raw.parse()
        if i % 2:  # streamed: the usage is in response.completed
            parsed = [e for e in parsed if e.type == "response.completed"][0].response
        seen.append((raw.headers["x-kvgate-pod"], int(raw.headers[PREDICTED]),
                     parsed.usage.input_tokens_details.cached_tokens))  # fmt: skip
    return seen


def messages_sequence(gateway: str, model: str, system: str, n: int = 4) -> Seen:
    client = anthropic.Anthropic(base_url=str(gateway), api_key="x", max_retries=0)
    seen = []
    for i in range(n):
        args = {"model": model, "system": system, "max_tokens": 2,
                "messages": [{"role": "user", "content": f"question {i}?"}]}  # fmt: skip
        if i % 2:  # streamed: the usage is in message_delta
            with client.messages.with_streaming_response.create(**args, stream=True) as raw:
                headers, lines = raw.headers, list(raw.iter_lines())
            delta = json.loads([x for x in lines if '"message_delta"' in x][0][len("data: ") :])
            cached = delta["usage"]["cache_read_input_tokens"]
        else:
            raw = client.messages.with_raw_response.create(**args)
            headers, cached = raw.headers, raw.parse().usage.cache_read_input_tokens
        seen.append((headers["x-kvgate-pod"], int(headers[PREDICTED]), cached))
    return seen


def chat_once(gateway: str, model: str, messages: list[dict]) -> tuple[str, int, int]:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=2
    )
    cached = raw.parse().usage.prompt_tokens_details.cached_tokens
    return raw.headers["x-kvgate-pod"], int(raw.headers[PREDICTED]), cached


def assert_follows_the_cache(seen: Seen, at_least: int) -> None:
    """One pod served all; every prediction was exact; repeats found the prefix."""
    assert len({pod for pod, _, _ in seen}) == 1, seen
    assert all(predicted == cached for _, predicted, cached in seen), seen
    assert all(cached >= at_least for _, _, cached in seen[1:]), seen
