"""Every error the gateway answers itself: status and OpenAI error shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from bench.gateway_proc import free_port, run_gateway
from tests.openai_errors import assert_openai_error

MODEL = "kvgate-tiny-llama"


@pytest.fixture(scope="module")
def dead_pod_gateway():
    """A gateway whose only pod (configured for MODEL) never answers."""
    dead = f"http://127.0.0.1:{free_port()}"
    with run_gateway(
        [("dead", f"{dead},models={MODEL}")],
        ready=False,
        env={"KVGATE_API_KEYS": "sk-good,sk-other", "KVGATE_MAX_BODY_BYTES": "4096"},
    ) as url:
        yield url


AUTH = {"authorization": "Bearer sk-good"}


def test_malformed_json_is_400(dead_pod_gateway):
    r = httpx.post(f"{dead_pod_gateway}/v1/chat/completions", content=b"{not json", headers=AUTH)
    err = assert_openai_error(r, 400)
    assert "not valid JSON" in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"content": "no role"}]}, "messages"),
        ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": 2},
         "stream"),  # vLLM reads 1, "yes" and "on" as true, and refuses 2
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "maybe"},
         "stream"),
    ],
)  # fmt: skip
def test_wrong_chat_fields_are_400_naming_the_field(dead_pod_gateway, body, param):
    r = httpx.post(f"{dead_pod_gateway}/v1/chat/completions", json=body, headers=AUTH)
    assert_openai_error(r, 400, param=param)


def test_completions_prompt_of_wrong_type_is_400(dead_pod_gateway):
    r = httpx.post(
        f"{dead_pod_gateway}/v1/completions", json={"model": MODEL, "prompt": 5}, headers=AUTH
    )
    assert_openai_error(r, 400, param="prompt")


def test_json_array_body_is_400(dead_pod_gateway):
    r = httpx.post(f"{dead_pod_gateway}/v1/completions", json=[1, 2], headers=AUTH)
    err = assert_openai_error(r, 400)
    assert "JSON object" in err["message"]


@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong", "Basic sk-good"])
def test_missing_or_invalid_api_key_is_401(dead_pod_gateway, auth):
    headers = {"authorization": auth} if auth else {}
    r = httpx.post(
        f"{dead_pod_gateway}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers=headers,
    )
    assert_openai_error(r, 401)


def test_official_client_sees_authentication_error(dead_pod_gateway):
    client = openai.OpenAI(base_url=f"{dead_pod_gateway}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])


def test_unknown_model_is_404_listing_known_models(dead_pod_gateway):
    r = httpx.post(
        f"{dead_pod_gateway}/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
        headers=AUTH,
    )
    err = assert_openai_error(r, 404, param="model")
    assert "no-such-model" in err["message"] and MODEL in err["message"]


def test_body_over_limit_is_413(dead_pod_gateway):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(f"{dead_pod_gateway}/v1/chat/completions", json=big, headers=AUTH)
    assert_openai_error(r, 413)


def test_chunked_body_over_limit_is_413(dead_pod_gateway):
    def chunks():
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = httpx.post(f"{dead_pod_gateway}/v1/completions", content=chunks(), headers=AUTH)
    assert_openai_error(r, 413)


def test_no_healthy_pod_is_503(dead_pod_gateway):
    r = httpx.post(
        f"{dead_pod_gateway}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
        headers=AUTH,
    )
    assert_openai_error(r, 503)


def test_ready_is_503_while_no_pod_is_healthy_but_health_is_200(dead_pod_gateway):
    assert httpx.get(f"{dead_pod_gateway}/health").status_code == 200
    r = httpx.get(f"{dead_pod_gateway}/ready")
    assert r.status_code == 503
    assert r.json()["models_without_healthy_pod"] == [MODEL]


def test_request_id_is_propagated_on_errors(dead_pod_gateway):
    r = httpx.post(
        f"{dead_pod_gateway}/v1/completions",
        content=b"[",
        headers={**AUTH, "x-request-id": "req-123"},
    )
    assert r.headers["x-request-id"] == "req-123"


def test_models_endpoint_needs_the_api_key_too(dead_pod_gateway):
    assert_openai_error(httpx.get(f"{dead_pod_gateway}/v1/models"), 401)
    assert httpx.get(f"{dead_pod_gateway}/v1/models", headers=AUTH).status_code == 200
