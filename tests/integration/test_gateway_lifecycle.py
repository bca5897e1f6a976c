"""A gateway process's life as a Kubernetes pod sees it: what its INFO log holds while
it probes its pods, and what SIGTERM (a rollout, a scale-down) does to the streams in
flight. A real ``kvgate serve`` in front of a simulated pod, the official client."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from bench.gateway_proc import run_gateway
from bench.polling import wait_for
from bench.sim.launch import sim_fleet

MODEL = "kvgate-tiny-llama"


def test_an_info_log_has_no_line_per_probe_but_says_when_a_pod_joins():
    """httpx logs every request at INFO: the probes (health, models and metrics of
    every pod every 0.5 s here) would be most of the log."""
    with (
        sim_fleet(1, itl_s=0.001, default_max_tokens=2) as (pod,),
        run_gateway([(pod.name, pod.url)], extra_args=["--log-level", "info"]) as gw,
    ):
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0)
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        time.sleep(1.6)  # three more probe rounds
        assert gw.log is not None
        log = gw.log.read_text()
    assert f"pod {pod.name} in rotation" in log, log[-2000:]
    assert "HTTP Request:" not in log, log[-2000:]


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_lets_the_streams_in_flight_finish_and_takes_no_new_connection(workers):
    """What the Deployment's preStop sleep and grace period rely on: after SIGTERM the
    listener closes at once (a new connection is refused, so the Service's other
    replicas get it), and a stream already running ends whole, with its last chunk."""
    tokens = 30
    with (
        sim_fleet(1, itl_s=0.05, default_max_tokens=2) as (pod,),
        run_gateway([(pod.name, pod.url)], workers=workers) as gw,
    ):
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0)
        started = threading.Event()
        chunks: list[openai.types.Completion] = []

        def stream() -> None:
            for chunk in client.completions.create(
                model=MODEL, prompt="a long answer", max_tokens=tokens, stream=True
            ):
                chunks.append(chunk)
                started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(10)
        os.kill(gw.pid, signal.SIGTERM)
        wait_for(lambda: _refused(gw), 5, what="the listener closed")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{gw}/ready", timeout=2)
        reader.join(10)
        assert not reader.is_alive()
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] == "length", finish
        assert len(text) > 0 and sum(1 for c in chunks if c.choices and c.choices[0].text) == tokens
