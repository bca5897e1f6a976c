"""Fuzzed bodies against a real gateway (kv-aware, local tokenizer, events) in front of
simulated pods: never a gateway 5xx, and every 4xx in the API's error shape.

Bodies are drawn around each endpoint's real schema (right keys, wrong or odd values,
deep nesting, unicode, huge numbers) and as arbitrary JSON or bytes.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.sim_gateway import model_env, sim_pods_and_gateway

MODEL = "kvgate-tiny-llama"
BLOCK = 32
EXAMPLES = 250

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),  # fmt: skip
    max_leaves=12,
)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=60)})
odd_part = st.dictionaries(st.sampled_from(["type", "text", "image_url"]), json_value, max_size=3)
content = (
    st.text(max_size=200) | st.lists(text_part | odd_part | json_value, max_size=4) | json_value
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool"]) | json_value},
    optional={"content": content, "name": json_value, "tool_calls": json_value},
)
token_ids = st.lists(st.integers(-5, 2**33), max_size=80)
common = {
    "model": st.just(MODEL) | json_value,
    "stream": st.booleans() | json_value,
    "max_tokens": st.integers(-2, 8) | json_value,
    "cache_salt": st.text(max_size=10) | json_value,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_value,
}
chat_body = st.fixed_dictionaries(
    {"model": common["model"], "messages": st.lists(message, max_size=4) | json_value},
    optional={k: v for k, v in common.items() if k != "model"}
    | {
        "add_generation_prompt": json_value,
        "chat_template_kwargs": json_value,
        "tools": json_value,
        "continue_final_message": json_value,
    },  # fmt: skip
)
prompt = st.text(max_size=300) | token_ids | st.lists(token_ids, max_size=3) | json_value
completion_body = st.fixed_dictionaries(
    {"model": common["model"], "prompt": prompt},
    optional={k: v for k, v in common.items() if k != "model"} | {"add_special_tokens": json_value},
)
tokenize_body = st.fixed_dictionaries(
    {},
    optional={
        "model": common["model"],
        "prompt": prompt,
        "messages": st.lists(message, max_size=3),
    },
)
detokenize_body = st.fixed_dictionaries(
    {"model": common["model"], "tokens": token_ids | json_value}
)
raw_bytes = st.binary(max_size=200) | st.builds(lambda v: json.dumps(v).encode(), json_value)


def _encode(body: object) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


@pytest.fixture(scope="module")
def gateway():
    env = model_env(KVGATE_MAX_BODY_BYTES="65536")
    with (
        sim_pods_and_gateway(2, "kv-aware", env, itl_s=0.0) as (_, gw),
        httpx.Client(timeout=30) as client,
    ):
        yield gw, client


def _check(client: httpx.Client, url: str, body: object) -> None:
    r = client.post(url, content=_encode(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300], _encode(body)[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text[:300]
        assert isinstance(err["message"], str) and err["message"]


FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])  # fmt: skip


ENDPOINTS = [
    ("/v1/chat/completions", chat_body | raw_bytes),
    ("/v1/completions", completion_body | raw_bytes),
    ("/tokenize", tokenize_body | raw_bytes),
    ("/detokenize", detokenize_body | raw_bytes),
    ("admin /admin/index/lookup", chat_body | completion_body | raw_bytes),
]


@pytest.mark.parametrize(("endpoint", "bodies"), ENDPOINTS, ids=[e for e, _ in ENDPOINTS])
@FUZZ
@given(data=st.data())
def test_no_5xx_and_every_4xx_in_the_openai_shape(gateway, endpoint, bodies, data):
    gw, client = gateway
    base, path = (
        (gw.admin, endpoint.split()[1]) if endpoint.startswith("admin ") else (gw, endpoint)
    )
    _check(client, f"{base}{path}", data.draw(bodies, label="body"))
