"""Failure drills with real processes on loopback: simulated vLLM pods publishing KV
events, a real gateway in front, and the fault an SRE would cause before production."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from bench.gateway_proc import run_gateway
from bench.polling import scraped, wait_for
from bench.prompts import text_of_tokens
from bench.sim.launch import sim_fleet
from bench.tinymodel import ensure_tokenizer
from tests.sim_gateway import BLOCK, model_env, pod_spec

MODEL = "kvgate-tiny-llama"
PROMPT_TOKENS = 384


def _held(gw, prompt: str) -> dict[str, int]:
    """The index's L0 blocks of ``prompt`` per pod (admin lookup)."""
    r = httpx.post(f"{gw.admin}/admin/index/lookup", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    return {pod: held["l0_blocks"] for pod, held in r.json()["pods"].items()}


def _healthy(gw, pod: str, value: float) -> bool:
    return scraped(gw, "kvgate_pod_healthy", pod=pod) == [value]


def test_a_pod_ejected_for_a_blip_has_its_cache_relearnt_when_readmitted():
    """A pod that hangs for a moment (SIGSTOP: its probes time out) is ejected and its
    index entries dropped; it comes back with its cache intact. Its events used to be
    followed on from where they were, so what it held before the ejection never came
    back: kv-aware predicted 0 cached tokens for its prefixes for good. Readmitted,
    its history is replayed and the index knows its cache again."""
    env = model_env(KVGATE_HEALTH__PROBE_TIMEOUT_S="0.5", KVGATE_EXPOSE_PREDICTIONS="true")
    prompts = [
        text_of_tokens(PROMPT_TOKENS, seed=f"blip-{i}", tokenizer_dir=ensure_tokenizer())
        for i in range(3)
    ]
    blocks = PROMPT_TOKENS // BLOCK
    with (
        sim_fleet(2, kv_events=True, block_size=BLOCK, default_max_tokens=2) as (pod, other),
        run_gateway([pod_spec(p, replay=True) for p in (pod, other)], "kv-aware", env=env) as gw,
    ):
        for prompt in prompts:  # cached on `pod` only, learnt from its KV events
            httpx.post(f"{pod.url}/v1/completions", json={"model": MODEL, "prompt": prompt})
        for prompt in prompts:
            wait_for(lambda p=prompt: _held(gw, p) == {pod.name: blocks}, poll=0.1)

        assert pod.process is not None
        pod.process.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: _healthy(gw, pod.name, 0.0), timeout=15, poll=0.1)
            assert all(_held(gw, p) == {} for p in prompts)  # ejected: forgotten
        finally:
            pod.process.send_signal(signal.SIGCONT)
        wait_for(lambda: _healthy(gw, pod.name, 1.0), timeout=15, poll=0.1)

        for prompt in prompts:
            wait_for(
                lambda p=prompt: _held(gw, p) == {pod.name: blocks},
                timeout=10,
                what="the readmitted pod's cache in the index",
                poll=0.1,
            )
        body = {"model": MODEL, "prompt": prompts[0] + " and one more question", "max_tokens": 1}
        r = httpx.post(f"{gw}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-pod"] == pod.name  # routed to the cache, and it hit
        assert r.headers["x-kvgate-predicted-cached-tokens"] == str(PROMPT_TOKENS)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT_TOKENS


def _in_flight_at(gw, pod: str) -> float:
    return sum(scraped(gw, "kvgate_pod_in_flight_requests", pod=pod))


@pytest.mark.parametrize("retry_on_eject", [True, False])
def test_a_request_held_by_a_pod_that_freezes_is_served_by_another_once_it_is_ejected(
    retry_on_eject: bool,
) -> None:
    """A pod frozen mid-generation (SIGSTOP: a hung process, a node gone) keeps its
    connections open and silent; a non-streamed request waited for ``total_s`` (900 s
    by default). Ejected for failing its probes, the pod now gives the requests the
    client has seen nothing of to another pod at once; with
    ``health.retry_in_flight_on_eject`` off, the request waits for its deadline."""
    env = model_env(
        KVGATE_HEALTH__INTERVAL_S="0.3",
        KVGATE_HEALTH__PROBE_TIMEOUT_S="0.3",
        KVGATE_HEALTH__RETRY_IN_FLIGHT_ON_EJECT=str(retry_on_eject).lower(),
        KVGATE_TIMEOUTS__FIRST_BYTE_S="15",
        KVGATE_TIMEOUTS__TOTAL_S="15",
    )
    with (
        sim_fleet(2, block_size=BLOCK, itl_s=0.02) as pods,
        run_gateway([(p.name, p.url) for p in pods], "round-robin", env=env) as gw,
    ):
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0, timeout=30)
        result: dict[str, object] = {}

        def ask() -> None:
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "a long answer, please"}],
                    max_tokens=150,  # 3 s of decoding at 20 ms a token
                )
                result["pod"] = raw.headers["x-kvgate-pod"]
                result["tokens"] = raw.parse().usage.completion_tokens
            except openai.APIStatusError as exc:
                result["status"] = exc.status_code
            result["done"] = time.monotonic()

        asker = threading.Thread(target=ask)
        asker.start()
        wait_for(lambda: any(_in_flight_at(gw, p.name) for p in pods), timeout=10, poll=0.02)
        frozen = next(p for p in pods if _in_flight_at(gw, p.name))
        other = next(p for p in pods if p is not frozen)
        assert frozen.process is not None
        frozen.process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            wait_for(lambda: _healthy(gw, frozen.name, 0.0), timeout=10, poll=0.05)
            asker.join(timeout=20)
        finally:
            frozen.process.send_signal(signal.SIGCONT)
        assert not asker.is_alive()
        metrics = httpx.get(f"{gw}/metrics").text
        lost = f'kvgate_retries_total{{cause="pod_lost",model="{MODEL}"}} 1.0'
        if retry_on_eject:
            assert result.get("pod") == other.name, result
            assert result.get("tokens") == 150
            assert lost in metrics
            # ejected within ~2 probe rounds, then 3 s of answer from the other pod,
            # well before the deadline (15 s from arrival) the request used to wait for
            assert float(result["done"]) - stopped < 10  # type: ignore[arg-type]
        else:
            assert result.get("status") == 504, result  # its deadline, total_s
            assert 'cause="pod_lost"' not in metrics


@pytest.mark.parametrize("act_on_eject", [True, False])
def test_a_stream_whose_pod_freezes_mid_answer_ends_once_the_pod_is_ejected(
    act_on_eject: bool,
) -> None:
    """A stream whose client has bytes cannot change pods. Its pod frozen mid-answer,
    the stream used to wait ``stream_idle_s`` (60 s by default) for the next chunk;
    once the pod is ejected for failing its probes, a stream it has sent nothing for
    a probe interval ends at once with an SSE error event the client can act on."""
    env = model_env(
        KVGATE_HEALTH__INTERVAL_S="0.3",
        KVGATE_HEALTH__PROBE_TIMEOUT_S="0.3",
        KVGATE_HEALTH__RETRY_IN_FLIGHT_ON_EJECT=str(act_on_eject).lower(),
        KVGATE_TIMEOUTS__STREAM_IDLE_S="8",
    )
    with (
        sim_fleet(2, block_size=BLOCK, itl_s=0.02) as pods,
        run_gateway([(p.name, p.url) for p in pods], "round-robin", env=env) as gw,
    ):
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="none", max_retries=0, timeout=30)
        stream = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a long answer, please"}],
            max_tokens=300,  # 6 s of decoding at 20 ms a token
            stream=True,
        )
        frozen = next(p for p in pods if p.name == stream.headers["x-kvgate-pod"])
        assert frozen.process is not None
        chunks = iter(stream.parse())
        for _ in range(5):
            next(chunks)  # the client has its first chunks
        frozen.process.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(openai.APIError) as info:
                for _ in chunks:
                    pass
            ended_s = time.monotonic() - stopped
        finally:
            frozen.process.send_signal(signal.SIGCONT)
        print(f"\nthe stream ended {ended_s:.2f} s after the freeze")  # docs/deploy.md's number
        if act_on_eject:
            assert "stopped answering its probes" in str(info.value)
            # ejected within ~2-3 probe rounds of 0.3 s, then at once: it was quiet
            assert ended_s < 4, ended_s
        else:
            assert "sent nothing for 8 s mid-stream" in str(info.value)
            assert 7.5 <= ended_s < 9.5, ended_s  # stream_idle_s after its last chunk
