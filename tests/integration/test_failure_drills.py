"""Failure drills with real processes on loopback: simulated vLLM pods publishing KV
events, a real gateway in front, and the fault an SRE would cause before production."""

from __future__ import annotations

import signal

import httpx

from bench.gateway_proc import run_gateway
from bench.polling import wait_for
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
    return f'kvgate_pod_healthy{{pod="{pod}"}} {value}' in httpx.get(f"{gw}/metrics").text


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
