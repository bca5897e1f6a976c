"""Client keys are checked on every serving endpoint before any work; admin keys (never
client keys) on the admin app; a pod's own key goes upstream, a gateway key never does."""

from __future__ import annotations

import pytest

from gateway.apis import APIS, error_style
from tests.inproc.harness import API_REQUESTS as PROXIED_REQUESTS
from tests.inproc.harness import inproc_gateway
from tests.inproc.scripted_pod import MODEL, answer
from tests.openai_errors import assert_anthropic_error, assert_openai_error

assert set(PROXIED_REQUESTS) == {api.path for api in APIS}  # a new endpoint is covered here
STYLE = {api.path: error_style(api.kind) for api in APIS}
ENDPOINTS = [
    *(("POST", path, request) for path, request in PROXIED_REQUESTS.items()),
    ("GET", "/v1/models", {}),
]
IDS = [path for _, path, _ in ENDPOINTS]
ADMIN_ENDPOINTS = [
    ("POST", "/admin/kv-events?pod=pod-a", {"ts": 0.0, "events": []}),
    ("GET", "/admin/index/stats", None),
    ("POST", "/admin/index/lookup", {"model": MODEL, "prompt": "hello"}),
]
ADMIN_IDS = [path for _, path, _ in ADMIN_ENDPOINTS]
GOOD = {"authorization": "Bearer sk-good"}
ADMIN_KEY = {"authorization": "Bearer adm-1"}


@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong", "Basic sk-good", "sk-good"])
@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS, ids=IDS)
async def test_missing_wrong_or_non_bearer_key_is_401_before_any_work(
    pod_a, method, path, body, auth
):
    async with inproc_gateway(pod_a, api_keys=["sk-good", "sk-other"]) as g:
        headers = {"authorization": auth} if auth else {}
        r = await g.client.request(method, path, headers=headers, **body)
        if STYLE.get(path) == "anthropic":
            assert assert_anthropic_error(r, 401)["type"] == "authentication_error"
        else:
            assert assert_openai_error(r, 401)["type"] == "authentication_error"
        assert pod_a.received == []


@pytest.mark.parametrize(("method", "path", "body"), ENDPOINTS, ids=IDS)
async def test_right_key_is_200(pod_a, method, path, body):
    pod_a.default = answer({"count": 3, "tokens": [1, 2, 3]})  # /tokenize, /detokenize ...
    async with inproc_gateway(pod_a, api_keys=["sk-good", "sk-other"]) as g:
        r = await g.client.request(method, path, headers=GOOD, **body)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
async def test_an_x_api_key_header_is_a_client_key_too(pod_a, path):
    """Anthropic's clients send their key as ``x-api-key``."""
    async with inproc_gateway(pod_a, api_keys=["sk-good"]) as g:
        r = await g.client.post(path, headers={"x-api-key": "sk-good"},
                                **PROXIED_REQUESTS[path])  # fmt: skip
        assert r.status_code == 200, r.text
        wrong = await g.client.post(path, headers={"x-api-key": "sk-bad"},
                                    **PROXIED_REQUESTS[path])  # fmt: skip
        assert wrong.status_code == 401
        assert "x-api-key" not in pod_a.received[0].headers


async def test_pod_key_replaces_the_clients_key_upstream(start_pod):
    pod = await start_pod("pod-k", api_key="sk-pod")
    async with inproc_gateway(pod, api_keys=["sk-good"]) as g:
        r = await g.chat(headers=GOOD)
        assert r.status_code == 200, r.text
        assert pod.received[0].headers["authorization"] == "Bearer sk-pod"


async def test_a_gateway_key_is_never_forwarded_to_a_pod(pod_a):
    async with inproc_gateway(pod_a, api_keys=["sk-good"]) as g:
        assert (await g.chat(headers=GOOD)).status_code == 200
        assert "authorization" not in pod_a.received[0].headers


async def test_without_gateway_keys_the_clients_authorization_is_forwarded(pod_a):
    async with inproc_gateway(pod_a) as g:
        assert (await g.chat(headers={"authorization": "Bearer for-the-pod"})).status_code == 200
        assert pod_a.received[0].headers["authorization"] == "Bearer for-the-pod"


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ENDPOINTS, ids=ADMIN_IDS)
async def test_admin_paths_are_not_on_the_serving_app(pod_a, method, path, body):
    async with inproc_gateway(pod_a, api_keys=["sk-good"], admin={"api_keys": ["adm-1"]}) as g:
        for headers in ({}, GOOD, ADMIN_KEY):
            r = await g.client.request(method, path, json=body, headers=headers)
            assert_openai_error(r, 404)


@pytest.mark.parametrize("auth", [None, "Bearer sk-good", "Bearer adm-wrong", "Basic adm-1"])
@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ENDPOINTS, ids=ADMIN_IDS)
async def test_only_an_admin_key_opens_the_admin_app(pod_a, method, path, body, auth):
    async with inproc_gateway(pod_a, api_keys=["sk-good"], admin={"api_keys": ["adm-1"]}) as g:
        headers = {"authorization": auth} if auth else {}
        r = await g.admin.request(method, path, json=body, headers=headers)
        assert assert_openai_error(r, 401)["type"] == "authentication_error"
        assert pod_a.received == []


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ENDPOINTS, ids=ADMIN_IDS)
async def test_the_admin_key_opens_the_admin_app(pod_a, method, path, body):
    pod_a.default = answer({"count": 3, "tokens": [1, 2, 3]})  # lookup asks the pod
    async with inproc_gateway(pod_a, api_keys=["sk-good"], admin={"api_keys": ["adm-1"]}) as g:
        r = await g.admin.request(method, path, json=body, headers=ADMIN_KEY)
        assert r.status_code == 200, r.text
