"""Raw bodies a client might send, answered by a vLLM pod directly and through the
gateway (round-robin, and kv-aware, which tokenizes the prompt in the gateway): the
status and content type must agree. Each case here once differed; the unit tests of
``tests/unit/test_vllm_parity.py`` say why each is read as it is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from bench.gateway_proc import run_gateway
from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME, VllmServer
from tests.e2e.prompts import prompt_text

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses", "messages": "/v1/messages",
         "count": "/v1/messages/count_tokens", "tokenize": "/tokenize",
         "detokenize": "/detokenize"}  # fmt: skip
JSON = "application/json"
# name: (api, fields over the API's base body (None: drop the field), raw suffix inside
# the object, encoding, content type)
CASES: dict[str, tuple[str, dict, bytes, str, str | None]] = {
    "chat without model": ("chat", {"model": None}, b"", "utf-8", JSON),
    "completion with model ''": ("completions", {"model": ""}, b"", "utf-8", JSON),
    "responses with model ''": ("responses", {"model": ""}, b"", "utf-8", JSON),
    "tokenize with model ''": ("tokenize", {"model": ""}, b"", "utf-8", JSON),
    "messages with model '' (refused)": ("messages", {"model": ""}, b"", "utf-8", JSON),
    "chat in UTF-16": ("chat", {}, b"", "utf-16", JSON),
    "completion in UTF-32": ("completions", {}, b"", "utf-32", JSON),
    "a field of NaN": ("chat", {}, b', "zz": NaN', "utf-8", JSON),
    "a field of 1e400": ("completions", {}, b', "zz": 1e400', "utf-8", JSON),
    "user with a lone surrogate": ("chat", {}, b', "user": "a\\ud800"', "utf-8", JSON),
    "stream_options 'x' on responses": ("responses", {"stream_options": "x"}, b"", "utf-8", JSON),
    "stream_options 'x' on messages": ("messages", {"stream_options": "x"}, b"", "utf-8", JSON),
    "stream 'x' on count_tokens": ("count", {"stream": "x"}, b"", "utf-8", JSON),
    "stream 2 on tokenize": ("tokenize", {"stream": 2}, b"", "utf-8", JSON),
    "stream_options 'x' on detokenize": (
        "detokenize",
        {"stream_options": "x"},
        b"",
        "utf-8",
        JSON,
    ),  # fmt: skip
    "content {}": (
        "chat",
        {"messages": [{"role": "user", "content": {}}, {"role": "user", "content": "hi"}]},
        b"",
        "utf-8",
        JSON,
    ),  # fmt: skip
    "token ids ' 1', '+1', '1_0'": (
        "completions",
        {"prompt": [" 1", "+1", "1_0", 2]},
        b"",
        "utf-8",
        JSON,
    ),  # fmt: skip
    "token id '2.0'": ("completions", {"prompt": [1, "2.0"]}, b"", "utf-8", JSON),
    "tokenize prompt, messages null": ("tokenize", {"messages": None}, b"", "utf-8", JSON),
    "tokenize prompt, messages 'x'": ("tokenize", {"messages": "x"}, b"", "utf-8", JSON),
    "text/plain (refused)": ("chat", {}, b"", "utf-8", "text/plain"),
    "+json media type (refused)": ("completions", {}, b"", "utf-8", "application/vnd.a+json"),
    "form media type (refused)": (
        "tokenize",
        {},
        b"",
        "utf-8",
        "application/x-www-form-urlencoded",
    ),  # fmt: skip
    "charset parameter": ("chat", {}, b"", "utf-8", "Application/JSON; charset=utf-8"),
    "stream 1": ("chat", {"stream": 1}, b"", "utf-8", JSON),
    "stream 'yes'": ("chat", {"stream": "yes"}, b"", "utf-8", JSON),
    "stream 0.0": ("chat", {"stream": 0.0}, b"", "utf-8", JSON),
    "stream 2 (refused)": ("chat", {"stream": 2}, b"", "utf-8", JSON),
    "byte order mark": ("chat", {}, b"", "utf-8-sig", JSON),
    "token ids as floats": ("completions", {"prompt": [1.0, 2.0, 3.0]}, b"", "utf-8", JSON),
    "token id 1.5 (refused)": ("completions", {"prompt": [1.5, 2.0]}, b"", "utf-8", JSON),
}


def _base(api: str, text: str) -> dict:
    user = [{"role": "user", "content": text}]
    return {
        "chat": {"model": MODEL_NAME, "max_tokens": 2, "messages": user},
        "completions": {"model": MODEL_NAME, "max_tokens": 2, "prompt": text},
        "responses": {"model": MODEL_NAME, "max_output_tokens": 16, "input": text},
        "messages": {"model": MODEL_NAME, "max_tokens": 2, "messages": user},
        "count": {"model": MODEL_NAME, "messages": user},
        "tokenize": {"model": MODEL_NAME, "prompt": text},
        "detokenize": {"model": MODEL_NAME, "tokens": [1, 2, 3]},
    }[api]


def _request(case: str, text: str) -> tuple[str, bytes, dict[str, str]]:
    api, fields, suffix, encoding, content_type = CASES[case]
    body = _base(api, text) | fields
    body = {k: v for k, v in body.items() if v is not None or k != "model"}
    raw = json.dumps(body)[:-1].encode() + suffix + b"}"
    raw = raw.decode().encode(encoding)
    return PATHS[api], raw, {"content-type": content_type} if content_type else {}


@pytest.fixture(scope="module")
def gateways(vllm_pods: list[VllmServer], tiny_tokenizer_dir) -> Iterator[dict[str, str]]:
    pods = [(f"pod-{i}", pod.url) for i, pod in enumerate(vllm_pods)]
    models = {MODEL_NAME: {"block_size": BLOCK_SIZE, "tokenizer": str(tiny_tokenizer_dir)}}
    env = {"KVGATE_MODELS": json.dumps(models)}
    with (
        run_gateway(pods, "round-robin") as rr,
        run_gateway(pods, "kv-aware", env=env) as kv,
    ):
        yield {"round-robin": rr, "kv-aware": kv}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bodies_are_answered_like_the_pod_answers_them(gateways, vllm_pods, nonce, case):
    path, raw, headers = _request(case, prompt_text(nonce, 10))
    bases = {"pod": vllm_pods[0].url, **gateways}
    answers = {name: httpx.post(base + path, content=raw, headers=headers, timeout=60)
               for name, base in bases.items()}  # fmt: skip
    seen = {name: (r.status_code, r.headers["content-type"].split(";")[0])
            for name, r in answers.items()}  # fmt: skip
    assert seen["round-robin"] == seen["pod"] == seen["kv-aware"], (
        seen, {n: r.text[:200] for n, r in answers.items()})  # fmt: skip
    if CASES[case][4] not in (JSON, None) and seen["pod"][0] == 400:
        assert answers["round-robin"].json()["error"]["param"] == "content-type"
