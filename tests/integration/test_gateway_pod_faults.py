"""Pods that hang: on generation (timeouts count toward ejection), on /tokenize (bounded,
fails over), and clients that leave a non-streamed request (the pod stops working on it).
Real gateway, simulated pods with injected faults."""

from __future__ import annotations

import threading
import time

import httpx
import openai

from bench.gateway_proc import run_gateway
from bench.polling import metric_value, scraped, wait_for
from bench.sim.launch import sim_fleet
from tests.openai_errors import assert_openai_error
from tests.sim_gateway import model_env, sim_pods_and_gateway

MODEL = "kvgate-tiny-llama"
BLOCK = 32


def _chat(question: str, **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 2,
            **extra}  # fmt: skip


def _arm(pod_url: str, mode: str, count: int) -> None:
    httpx.post(f"{pod_url}/sim/faults", json={"mode": mode, "count": count}).raise_for_status()


def test_a_pod_that_hangs_on_generation_is_ejected_after_m_timeouts():
    env = {
        "KVGATE_TIMEOUTS__FIRST_BYTE_S": "0.5",
        "KVGATE_TIMEOUTS__TOTAL_S": "0.5",  # what bounds a non-streamed answer
        "KVGATE_HEALTH__EJECT_AFTER_FAILED_REQUESTS": "2",
        "KVGATE_HEALTH__READMIT_AFTER_SUCCESSES": "1000",
    }
    with (
        sim_fleet(2, itl_s=0.001, default_max_tokens=2) as (hung, ok),
        run_gateway([(hung.name, hung.url), (ok.name, ok.url)], "round-robin", env=env) as gw,
    ):
        _arm(hung.url, "hang", 1000)  # answers /health, never a generation
        statuses = []
        for i in range(8):
            started = time.monotonic()
            r = httpx.post(f"{gw}/v1/chat/completions", json=_chat(f"q{i}"), timeout=10)
            statuses.append((r.status_code, r.headers.get("x-kvgate-pod")))
            if r.status_code == 504:
                assert_openai_error(r, 504)
                assert time.monotonic() - started < 3  # the deadline, not 900 s
        timeouts = [s for s in statuses if s[0] == 504]
        assert len(timeouts) == 2  # then the pod is out of rotation
        assert statuses[-4:] == [(200, ok.name)] * 4
        metrics = httpx.get(f"{gw}/metrics").text
        assert f'kvgate_pod_healthy{{pod="{hung.name}"}} 0.0' in metrics
        assert metric_value(metrics, "kvgate_pod_ejections_total") == 1


def test_a_non_streamed_generation_longer_than_the_first_byte_deadline_is_answered():
    """vLLM sends a non-streamed answer whole once generated: cut at first_byte_s, every
    generation longer than it was a 504 (the client's SDK retried it twice) and counted
    against a healthy pod until it was ejected."""
    env = {
        "KVGATE_TIMEOUTS__FIRST_BYTE_S": "0.3",
        "KVGATE_HEALTH__EJECT_AFTER_FAILED_REQUESTS": "1",
    }
    tokens = 20
    with (
        sim_fleet(1, itl_s=0.05, default_max_tokens=2) as (pod,),
        run_gateway([(pod.name, pod.url)], "round-robin", env=env) as gw,
    ):
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0)
        started = time.monotonic()
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=tokens
        )
        assert time.monotonic() - started > 0.3 * 2  # well past first_byte_s
        assert answer.usage is not None and answer.usage.completion_tokens == tokens
        metrics = httpx.get(f"{gw}/metrics").text
        assert f'kvgate_pod_healthy{{pod="{pod.name}"}} 1.0' in metrics
        assert metric_value(metrics, "kvgate_pod_ejections_total") == 0


def test_a_streamed_request_to_a_hung_pod_gets_504_within_the_first_byte_deadline():
    env = {"KVGATE_TIMEOUTS__FIRST_BYTE_S": "0.5"}
    with (
        sim_fleet(1, itl_s=0.001, default_max_tokens=2) as (hung,),
        run_gateway([(hung.name, hung.url)], env=env) as gw,
    ):
        _arm(hung.url, "hang", 1)
        started = time.monotonic()
        r = httpx.post(f"{gw}/v1/chat/completions", json=_chat("s", stream=True), timeout=10)
        assert_openai_error(r, 504)
        assert time.monotonic() - started < 3


def test_a_pod_whose_tokenize_hangs_delays_requests_only_by_the_tokenize_timeout():
    env = model_env("engine", KVGATE_TIMEOUTS__TOKENIZE_S="0.5")
    with sim_pods_and_gateway(2, "kv-aware", env) as (pods, gw):
        _arm(pods[0].url, "hang_tokenize", 1000)
        took = []
        for i in range(6):
            started = time.monotonic()
            r = httpx.post(f"{gw}/v1/chat/completions", json=_chat(f"t{i}"), timeout=30)
            took.append(time.monotonic() - started)
            assert r.status_code == 200, r.text
        # One 0.5 s timeout, then the other pod's /tokenize; without the bound a request
        # waited for the shared client's 900 s. (Slack for a loaded machine.)
        assert max(took) < 8.0
        metrics = httpx.get(f"{gw}/metrics").text
        assert metric_value(metrics, "kvgate_tokenize_failures_total") == 0  # failed over
        fired = httpx.get(f"{pods[0].url}/sim/state").json()["faults"]["fired"]
        assert fired.get("hang_tokenize", 0) >= 1  # the hung pod was asked, and timed out


def test_a_client_leaving_a_non_streamed_request_cancels_it_on_the_pod():
    with (
        sim_fleet(1, itl_s=0.05, default_max_tokens=400) as (pod,),
        run_gateway([(pod.name, pod.url)]) as gw,
    ):

        def leave_early() -> None:
            try:  # ~20 s of generation; the client gives up after 1 s
                httpx.post(
                    f"{gw}/v1/chat/completions", json=_chat("long", max_tokens=400), timeout=1.0
                )
            except httpx.TimeoutException:
                pass

        client = threading.Thread(target=leave_early)
        client.start()

        def running() -> float:
            return sum(scraped(pod.url, "vllm:num_requests_running"))

        wait_for(lambda: running() == 1, timeout=5, what="the pod to start the request")
        client.join()
        wait_for(lambda: running() == 0, timeout=3, what="the pod to drop the request")
        metrics = httpx.get(f"{gw}/metrics").text
        assert 'status="499"' in metrics
        assert metric_value(metrics, "kvgate_pod_in_flight_requests") == 0
