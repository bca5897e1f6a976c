"""The bounds on requests in flight: how many a process serves at once and how many body
bytes they hold (``gateway/in_flight.py``). A real gateway in front of a simulated pod
that hangs, so that requests stay in flight as long as the test needs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from bench.gateway_proc import GatewayURL, run_gateway
from bench.polling import wait_for
from bench.sim.launch import SimPod, sim_fleet
from gateway.config import Settings
from tests.openai_errors import assert_openai_error

MODEL = "kvgate-tiny-llama"
FIRST_BYTE_S = 3.0  # how long a hung request stays in flight before its 504
ENV = {
    "KVGATE_MAX_REQUESTS_IN_FLIGHT": "3",
    "KVGATE_MAX_BODY_BYTES": "4096",
    "KVGATE_MAX_BODY_BYTES_IN_FLIGHT": "6000",
    "KVGATE_TIMEOUTS__FIRST_BYTE_S": str(FIRST_BYTE_S),
    "KVGATE_TIMEOUTS__TOTAL_S": str(FIRST_BYTE_S),  # the deadline of a non-streamed answer
    "KVGATE_HEALTH__EJECT_AFTER_FAILED_REQUESTS": "1000",  # the hung pod stays in rotation
}


def _chat(content_bytes: int) -> dict:
    return {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": "x" * content_bytes}]}  # fmt: skip


def _held(gw: GatewayURL) -> tuple[int, int]:
    """Requests in flight and the body bytes they hold, from ``/admin/bounds``."""
    s = httpx.get(f"{gw.admin}/admin/bounds").json()["structures"]
    return s["requests.in_flight"]["size"], s["requests.body_bytes"]["size"]


@pytest.fixture
def hung() -> Iterator[tuple[SimPod, GatewayURL]]:
    with (
        sim_fleet(1, itl_s=0.001, default_max_tokens=2) as (pod,),
        run_gateway([(pod.name, pod.url)], env=ENV) as gw,
    ):
        httpx.post(f"{pod.url}/sim/faults", json={"mode": "hang", "count": 1000})
        yield pod, gw


def _in_background(gw: GatewayURL, body: dict, out: list[int]) -> threading.Thread:
    def send() -> None:
        r = httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=FIRST_BYTE_S + 10)
        out.append(r.status_code)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_a_request_past_the_count_is_503_with_retry_after_then_admitted_again(hung):
    _, gw = hung
    finished: list[int] = []
    threads = [_in_background(gw, _chat(100), finished) for _ in range(3)]
    wait_for(lambda: _held(gw)[0] == 3, 10, what="three requests in flight")
    client = openai.OpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(**_chat(100))
    assert time.monotonic() - started < FIRST_BYTE_S / 2  # at once, not once a slot frees
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["code"] == "gateway_at_capacity"
    for thread in threads:
        thread.join()
    assert finished == [504, 504, 504]  # the admitted ones ran their course untouched
    metrics = httpx.get(f"{gw}/metrics").text
    assert 'kvgate_requests_refused_total{bound="requests"} 1.0' in metrics
    assert _held(gw) == (0, 0)  # all released: the next request is admitted (and hangs)
    r = httpx.post(f"{gw}/v1/chat/completions", json=_chat(100), timeout=FIRST_BYTE_S + 10)
    assert_openai_error(r, 504)


def test_a_body_past_the_bytes_bound_is_503_and_a_smaller_one_still_fits(hung):
    _, gw = hung
    finished: list[int] = []
    first = _in_background(gw, _chat(3000), finished)
    wait_for(lambda: _held(gw)[0] == 1, 10, what="a request in flight")
    held = _held(gw)[1]
    assert 3000 < held < 3200  # its body, charged by its declared length
    r = httpx.post(f"{gw}/v1/chat/completions", json=_chat(3000))
    err = assert_openai_error(r, 503)
    assert "bytes" in err["message"] and r.headers["retry-after"] == "1"
    assert _held(gw) == (1, held)  # the refused request charged nothing and left no count

    def chunked() -> Iterator[bytes]:  # no Content-Length: charged chunk by chunk
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(4):
            yield b"y" * 1000
        yield b'"}'

    r = httpx.post(f"{gw}/v1/completions", content=chunked())
    assert_openai_error(r, 503)
    second = _in_background(gw, _chat(1000), finished)  # 3,100 + 1,100 fit in 6,000
    wait_for(lambda: _held(gw)[0] == 2, 10, what="two requests in flight")
    first.join()
    second.join()
    assert finished == [504, 504]
    assert _held(gw) == (0, 0)
    metrics = httpx.get(f"{gw}/metrics").text
    assert 'kvgate_requests_refused_total{bound="body_bytes"} 2.0' in metrics


def test_a_bound_on_bodies_below_the_body_limit_is_refused():
    with pytest.raises(ValueError, match="max_body_bytes_in_flight"):
        Settings(max_body_bytes=8192, max_body_bytes_in_flight=4096)
