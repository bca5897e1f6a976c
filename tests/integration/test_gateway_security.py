"""A client, however hostile, reaches neither the index nor the admin paths nor another
tenant's cache: admin listener, admin keys, per-pod event keys, prediction headers,
forwarded credentials, tenant salts. Real gateways and simulated pods on loopback."""

from __future__ import annotations

import httpx
import msgspec
import openai
import pytest

from bench.gateway_proc import run_gateway
from bench.sim.launch import sim_fleet
from tests.openai_errors import assert_openai_error
from tests.sim_gateway import model_env

MODEL = "kvgate-tiny-llama"
BLOCK = 32
CLIENT = {"authorization": "Bearer sk-client"}
ADMIN = {"authorization": "Bearer adm-1"}
SYSTEM = " ".join(f"policy clause {i} is confidential" for i in range(120))


def _chat(question: str, **extra: object) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 2, **extra}


def _event_batch(tokens: list[int]) -> bytes:
    """One vLLM BlockStored batch (msgpack) claiming the pod holds ``tokens``' block."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [987654321],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
    }
    return msgspec.msgpack.encode([0.0, [stored], 0])  # fmt: skip


@pytest.fixture(scope="module")
def fleet():
    with sim_fleet(2, kv_events=True, block_size=BLOCK, itl_s=0.001, default_max_tokens=2) as p:
        yield p


@pytest.fixture(scope="module")
def locked(fleet):
    """Client keys, admin keys, and pod b with its own events key."""
    a, b = fleet
    pods = [(a.name, f"{a.url},events={a.events_endpoint}"), (b.name, f"{b.url},events_key=ev-b")]
    env = model_env(KVGATE_API_KEYS="sk-client", KVGATE_ADMIN__API_KEYS="adm-1")
    with run_gateway(pods, strategy="kv-aware", env=env) as gw:
        yield gw


ADMIN_PATHS = [("GET", "/admin/index/stats"), ("POST", "/admin/index/lookup"),
               ("POST", "/admin/kv-events?pod=sim-0"), ("GET", "/admin/pods")]  # fmt: skip


@pytest.mark.parametrize(("method", "path"), ADMIN_PATHS)
@pytest.mark.parametrize("headers", [{}, CLIENT, ADMIN])
def test_admin_paths_do_not_exist_on_the_serving_port(locked, method, path, headers):
    r = httpx.request(method, f"{locked}{path}", content=b"{}", headers=headers)
    assert_openai_error(r, 404)


@pytest.mark.parametrize(("method", "path"), ADMIN_PATHS)
@pytest.mark.parametrize("headers", [{}, CLIENT, {"authorization": "Bearer adm-2"}])
def test_only_an_admin_key_opens_the_admin_listener(locked, method, path, headers):
    r = httpx.request(method, f"{locked.admin}{path}", content=b"{}", headers=headers)
    assert_openai_error(r, 401)


def test_an_admin_key_reads_the_index(locked):
    r = httpx.get(f"{locked.admin}/admin/index/stats", headers=ADMIN)
    assert r.status_code == 200 and r.json()["backend"] == "memory"


def test_an_admin_key_lists_the_pods_as_routing_sees_them(locked, fleet):
    client = openai.OpenAI(base_url=f"{locked}/v1", api_key="sk-client", max_retries=0)
    stream = client.chat.completions.create(**_chat("who?", max_tokens=2000), stream=True)
    next(iter(stream))  # a request in flight until the stream is read to its end
    listed = httpx.get(f"{locked.admin}/admin/pods", headers=ADMIN).json()["pods"]
    stream.close()
    assert [(p["name"], p["url"], p["healthy"], p["models"]) for p in listed] == [
        (pod.name, pod.url, True, [MODEL]) for pod in fleet
    ]
    assert sum(p["in_flight"] for p in listed) == 1
    assert all(p["engine"]["kv_capacity_blocks"] > 0 for p in listed)  # scraped
    assert all(p["speed"] == {} for p in listed)  # no pod told apart from the average yet


def test_a_pod_posts_its_own_events_with_its_events_key_and_no_other_pods(locked, fleet):
    a, b = fleet
    batch = _event_batch(list(range(BLOCK)))
    msgpack = {"content-type": "application/msgpack"}
    own = httpx.post(f"{locked.admin}/admin/kv-events?pod={b.name}", content=batch,
                     headers={**msgpack, "authorization": "Bearer ev-b"})  # fmt: skip
    assert own.status_code == 200 and own.json() == {"applied_ops": 1}
    other = httpx.post(f"{locked.admin}/admin/kv-events?pod={a.name}", content=batch,
                       headers={**msgpack, "authorization": "Bearer ev-b"})  # fmt: skip
    assert_openai_error(other, 401)


def test_admin_bodies_over_their_limit_are_413(fleet):
    a, _ = fleet
    env = model_env(KVGATE_ADMIN__MAX_BODY_BYTES="4096")
    with run_gateway([(a.name, a.url)], env=env) as gw:
        r = httpx.post(f"{gw.admin}/admin/kv-events?pod={a.name}", content=b"[" * 5000)
        assert_openai_error(r, 413)


def test_lookups_of_models_nobody_serves_are_404_and_add_no_metric_series(fleet):
    a, _ = fleet
    with run_gateway([(a.name, a.url)], env=model_env()) as gw:
        for i in range(5):
            r = httpx.post(f"{gw.admin}/admin/index/lookup", json={"model": f"guess-{i}",
                                                                   "prompt": "x"})  # fmt: skip
            assert_openai_error(r, 404, param="model")
        assert "guess-" not in httpx.get(f"{gw}/metrics").text


def test_prediction_headers_go_only_to_callers_with_an_admin_key(locked):
    plain = httpx.post(f"{locked}/v1/chat/completions", json=_chat("q1"), headers=CLIENT)
    assert plain.status_code == 200
    assert not [h for h in plain.headers if h.startswith("x-kvgate-predicted")]
    admin = httpx.post(f"{locked}/v1/chat/completions", json=_chat("q1"),
                       headers={**CLIENT, "x-kvgate-admin-key": "adm-1"})  # fmt: skip
    assert int(admin.headers["x-kvgate-predicted-cached-tokens"]) > 0


def test_the_clients_gateway_key_never_reaches_a_pod(locked, fleet):
    r = httpx.post(f"{locked}/v1/chat/completions", json=_chat("q2"), headers=CLIENT)
    pod = next(p for p in fleet if p.name == r.headers["x-kvgate-pod"])
    assert httpx.get(f"{pod.url}/sim/state").json()["last_authorization"] is None


def test_without_gateway_keys_the_clients_authorization_passes_through(fleet):
    a, _ = fleet
    with run_gateway([(a.name, a.url)], env=model_env()) as gw:
        r = httpx.post(f"{gw}/v1/chat/completions", json=_chat("q3"),
                       headers={"authorization": "Bearer pod-token"})  # fmt: skip
        assert r.status_code == 200
        assert httpx.get(f"{a.url}/sim/state").json()["last_authorization"] == "Bearer pod-token"


def test_metrics_can_move_to_the_admin_listener(fleet):
    a, _ = fleet
    with run_gateway([(a.name, a.url)], env=model_env(KVGATE_ADMIN__METRICS="true")) as gw:
        assert_openai_error(httpx.get(f"{gw}/metrics"), 404)
        assert "kvgate_requests_total" in httpx.get(f"{gw.admin}/metrics").text


def test_there_is_no_openapi_schema_or_docs_page(locked):
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert_openai_error(httpx.get(f"{locked}{path}", headers=CLIENT), 404)


def _cached(gw: str, key: str, question: str) -> tuple[int, int]:
    """(predicted, served) cached tokens of one chat request as tenant ``key``."""
    r = httpx.post(
        f"{gw}/v1/chat/completions",
        json=_chat(question),
        headers={"authorization": f"Bearer {key}", "x-kvgate-admin-key": "adm-1"},
    )
    assert r.status_code == 200, r.text
    served = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(r.headers["x-kvgate-predicted-cached-tokens"]), served


def test_tenants_never_share_cache_in_the_pod_or_the_index(fleet):
    env = model_env(
        KVGATE_API_KEYS="sk-a,sk-b",
        KVGATE_ADMIN__API_KEYS="adm-1",
        KVGATE_TENANT_ISOLATION__ENABLED="true",
        KVGATE_TENANT_ISOLATION__SECRET="s3cret",
    )
    pods = [(p.name, f"{p.url},events={p.events_endpoint}") for p in fleet]
    with run_gateway(pods, strategy="kv-aware", env=env) as gw:
        assert _cached(gw, "sk-a", "first") == (0, 0)
        predicted, served = _cached(gw, "sk-a", "second")
        assert predicted > 0 and served > 0  # the tenant's own prefix is cached
        assert _cached(gw, "sk-b", "third") == (0, 0)  # another tenant's is not
