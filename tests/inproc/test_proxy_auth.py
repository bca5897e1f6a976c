"""Client keys are checked on every endpoint before any work; a pod's own key goes upstream."""

from __future__ import annotations

import pytest

from gateway.app import PROXIED
from tests.inproc.harness import CHAT, inproc_gateway
from tests.inproc.scripted_pod import MODEL, answer
from tests.openai_errors import assert_openai_error

PROXIED_BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "hello"},
    "/v1/embeddings": {"model": MODEL, "input": "hello"},
    "/tokenize": {"model": MODEL, "prompt": "hello"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
}
assert set(PROXIED_BODIES) == {path for path, _ in PROXIED}  # a new endpoint is covered here
ENDPOINTS = [
    *(("POST", path, body) for path, body in PROXIED_BODIES.items()),
    ("GET", "/v1/models", None),
    ("POST", "/admin/kv-events?pod=pod-a", {"ts": 0.0, "events": []}),
    ("GET", "/admin/index/stats", None),
    ("POST", "/admin/index/lookup", {"model": MODEL, "prompt": "hello"}),
]
IDS = [path for _, path, _ in ENDPOINTS]
GOOD = {"authorization": "Bearer sk-good"}


@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong", "Basic sk-good", "sk-good"])
@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS, ids=IDS)
async def test_missing_wrong_or_non_bearer_key_is_401_before_any_work(
    pod_a, method, path, body, auth
):
    async with inproc_gateway(pod_a, api_keys=["sk-good", "sk-other"]) as g:
        headers = {"authorization": auth} if auth else {}
        r = await g.client.request(method, path, json=body, headers=headers)
        assert assert_openai_error(r, 401)["type"] == "authentication_error"
        assert pod_a.received == []


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS, ids=IDS)
async def test_right_key_is_200(pod_a, method, path, body):
    # /admin/index/lookup tokenizes on the pod (no local tokenizer is configured).
    pod_a.default = answer({"count": 3, "tokens": [1, 2, 3]})
    async with inproc_gateway(pod_a, api_keys=["sk-good", "sk-other"]) as g:
        r = await g.client.request(method, path, json=body, headers=GOOD)
        assert r.status_code == 200, r.text


async def test_pod_key_replaces_the_clients_key_upstream(start_pod):
    pod = await start_pod("pod-k", api_key="sk-pod")
    async with inproc_gateway(pod, api_keys=["sk-good"]) as g:
        r = await g.chat(headers=GOOD)
        assert r.status_code == 200, r.text
        assert pod.received[0].headers["authorization"] == "Bearer sk-pod"


async def test_without_a_pod_key_the_clients_authorization_is_forwarded(pod_a):
    async with inproc_gateway(pod_a, api_keys=["sk-good"]) as g:
        assert (await g.chat(headers=GOOD)).status_code == 200
        assert pod_a.received[0].headers["authorization"] == "Bearer sk-good"
