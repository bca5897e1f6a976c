"""The gateway in front of real simulated-pod processes, driven by the openai client."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import httpx
import openai
import pytest

from bench.gateway_proc import run_gateway
from bench.polling import metric_value, scraped, wait_for
from bench.sim.launch import sim_fleet

MODEL = "kvgate-tiny-llama"
USER = [{"role": "user", "content": "Tell me about prefix caches and routing."}]


@pytest.fixture(scope="module")
def fleet():
    with sim_fleet(2, itl_s=0.002, overhead_s=0.001, default_max_tokens=8) as pods:
        yield pods


@pytest.fixture()
def gateway(fleet):
    with run_gateway(
        [(p.name, p.url) for p in fleet],
        env={"KVGATE_HEALTH__READMIT_AFTER_SUCCESSES": "2"},
    ) as url:
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0)


def arm(pod, mode: str, count: int = 1) -> None:
    httpx.post(f"{pod.url}/sim/faults", json={"mode": mode, "count": count}).raise_for_status()


def test_streaming_chat_through_gateway_yields_chunks_and_usage(gateway):
    stream = client(gateway).chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices]) >= 8
    assert text
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens > 0


def test_round_robin_alternates_pods_in_header(gateway, fleet):
    c = client(gateway)
    pods = []
    for _ in range(4):
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=USER)
        pods.append(raw.headers["x-kvgate-pod"])
        assert raw.headers["x-kvgate-strategy"] == "round-robin"
    assert pods[0] != pods[1] and pods[0] == pods[2] and pods[1] == pods[3]
    assert set(pods) == {p.name for p in fleet}


def test_non_streaming_completion_passes_usage_and_cached_tokens(gateway):
    c = client(gateway)
    prompt = "shared document " * 200
    # Twice to each pod (round-robin): the second visit to a pod hits its L0.
    usages = [
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage for _ in range(4)
    ]
    assert usages[0].prompt_tokens == usages[3].prompt_tokens
    assert usages[2].prompt_tokens_details.cached_tokens > 0
    assert usages[3].prompt_tokens_details.cached_tokens > 0


def test_extra_fields_such_as_cache_salt_reach_the_pod(gateway):
    c = client(gateway)
    prompt = "salted prefix " * 150
    for _ in range(2):  # warm both pods without a salt
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    salted = c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "tenant-a"}
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_request_id_is_propagated_or_generated(gateway):
    r = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": MODEL, "messages": USER},
        headers={"x-request-id": "abc-1"},
    )
    assert r.headers["x-request-id"] == "abc-1"
    r = httpx.post(f"{gateway}/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert len(r.headers["x-request-id"]) >= 16


def test_models_are_merged_and_tokenize_is_forwarded(gateway):
    models = client(gateway).models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.post(f"{gateway}/tokenize", json={"model": MODEL, "prompt": "hello world"})
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["tokens"]) > 0
    r = httpx.post(f"{gateway}/detokenize", json={"model": MODEL, "tokens": r.json()["tokens"]})
    assert r.json()["prompt"] == "hello world"


def test_5xx_before_first_byte_is_retried_on_the_other_pod(gateway, fleet):
    arm(fleet[0], "error_500", count=1)
    arm(fleet[1], "error_500", count=0)
    c = client(gateway)
    for _ in range(2):  # whichever pod round-robin picks first, both requests succeed
        raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=USER)
        assert raw.http_response.status_code == 200
    metrics = httpx.get(f"{gateway}/metrics").text
    assert 'kvgate_retries_total{cause="status_500",model="kvgate-tiny-llama"} 1.0' in metrics


def test_upstream_failure_on_every_pod_is_502(gateway, fleet):
    for pod in fleet:
        arm(pod, "error_500", count=1)
    r = httpx.post(f"{gateway}/v1/chat/completions", json={"model": MODEL, "messages": USER})
    assert r.status_code == 502
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_drop_after_first_byte_becomes_an_sse_error_event(gateway, fleet):
    for pod in fleet:
        arm(pod, "drop_mid_stream", count=1)
    stream = client(gateway).chat.completions.create(model=MODEL, messages=USER, stream=True)
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert "mid-stream" in str(info.value)
    for pod in fleet:
        arm(pod, "none")


def test_a_pod_past_the_deadline_is_504(fleet):
    deadlines = {"KVGATE_TIMEOUTS__FIRST_BYTE_S": "0.5", "KVGATE_TIMEOUTS__TOTAL_S": "0.5"}
    with run_gateway([(p.name, p.url) for p in fleet], env=deadlines) as url:
        for pod in fleet:
            arm(pod, "hang", count=1)
        r = httpx.post(
            f"{url}/v1/chat/completions", json={"model": MODEL, "messages": USER}, timeout=10
        )
        assert r.status_code == 504
        assert r.json()["error"]["type"] == "timeout_error"
        for pod in fleet:
            arm(pod, "none")


def test_client_disconnect_cancels_the_upstream_request(gateway, fleet):
    slow = {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 2000}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=slow) as r:
        pod = next(p for p in fleet if p.name == r.headers["x-kvgate-pod"])
        next(r.iter_bytes())
    # The gateway must close its upstream stream, so the pod stops generating.
    wait_for(
        lambda: sum(scraped(pod.url, "vllm:num_requests_running")) == 0,
        timeout=5,
        what=f"{pod.name} to stop generating",
        poll=0.1,
    )
    metrics = httpx.get(f"{gateway}/metrics").text
    assert metric_value(metrics, "kvgate_pod_in_flight_requests") == 0
    assert f'pod="{pod.name}",status="499"' in metrics  # counted as the client's doing


def test_killed_pod_is_ejected_requests_succeed_and_it_is_readmitted(fleet):
    with run_gateway(
        [(p.name, p.url) for p in fleet],
        env={
            "KVGATE_HEALTH__EJECT_AFTER_FAILED_PROBES": "2",
            "KVGATE_HEALTH__READMIT_AFTER_SUCCESSES": "2",
        },
    ) as url:
        c = client(url)
        errors: list[Exception] = []
        served: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                try:
                    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=USER)
                    served.append(raw.headers["x-kvgate-pod"])
                except Exception as exc:  # noqa: BLE001 - every failure is a test failure
                    errors.append(exc)

        worker = threading.Thread(target=traffic)
        worker.start()
        try:
            time.sleep(0.5)
            victim = fleet[0]
            victim.kill()
            _wait_healthy_gauge(url, victim.name, 0.0)
            n_before = len(served)
            time.sleep(0.5)
            assert set(served[n_before:]) == {fleet[1].name}
            victim.start()
            _wait_healthy_gauge(url, victim.name, 1.0)
            n_back = len(served)
            time.sleep(0.5)
            assert victim.name in served[n_back:]
        finally:
            stop.set()
            worker.join()
        assert errors == []


def _wait_healthy_gauge(url: str, pod: str, value: float) -> None:
    wait_for(lambda: scraped(url, "kvgate_pod_healthy", pod=pod) == [value], timeout=15,
             what=f"kvgate_pod_healthy of {pod} at {value}", poll=0.1)  # fmt: skip


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus) missing")
def test_promtool_finds_no_problems_in_metrics(gateway):
    client(gateway).chat.completions.create(model=MODEL, messages=USER)
    text = httpx.get(f"{gateway}/metrics").text
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""


@pytest.mark.parametrize("strategy", ["random", "power-of-two"])
def test_the_peers_load_only_policies_route_through_the_gateway(fleet, strategy):
    with run_gateway([(p.name, p.url) for p in fleet], strategy=strategy) as url:
        pods = []
        for _ in range(20):
            raw = client(url).chat.completions.with_raw_response.create(
                model=MODEL, messages=USER, max_tokens=2
            )
            assert raw.headers["x-kvgate-strategy"] == strategy
            pods.append(raw.headers["x-kvgate-pod"])
        assert set(pods) == {p.name for p in fleet}  # both pods, 2 x 0.5**20 odds otherwise
