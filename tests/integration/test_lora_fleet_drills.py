"""LoRA fleet drills: real simulated pods loading adapters at runtime, a real gateway."""

from __future__ import annotations

import json
import time

import httpx

from bench.gateway_proc import run_gateway
from bench.polling import wait_for
from bench.prompts import text_of_tokens
from bench.sim.launch import SimPod
from bench.tinymodel import ensure_tokenizer
from tests.sim_gateway import system_chat


def _pod(name: str, model: str) -> SimPod:
    return SimPod(name, {"served_model_name": model, "block_size": 16, "default_max_tokens": 2,
                         "allow_runtime_lora_updating": True}, {"kv_events": True})  # fmt: skip


def _chat(gw: str, model: str, system: str) -> tuple[int, str | None, str | None, int | None]:
    r = system_chat(gw, model, system)
    if r.status_code != 200:
        return r.status_code, None, None, None
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    pod = r.headers.get("x-kvgate-pod")
    return r.status_code, pod, r.headers.get("x-kvgate-predicted-cached-tokens"), cached


def _gateway(pods: list[SimPod], models: list[str]):
    tok = str(ensure_tokenizer())
    specs = [(p.name, f"{p.url},events={p.events_endpoint},replay={p.replay_endpoint}")
             for p in pods]  # fmt: skip
    env = {"KVGATE_MODELS": json.dumps({m: {"block_size": 16, "tokenizer": tok} for m in models}),
           "KVGATE_EXPOSE_PREDICTIONS": "true", "KVGATE_INDEX__SPECULATIVE_TTL_S": "0",
           "KVGATE_HEALTH__INTERVAL_S": "1"}  # fmt: skip
    return run_gateway(specs, strategy="kv-aware", env=env), tok


def test_a_runtime_adapter_is_routed_to_its_pod_predicted_exactly_and_gone_when_unloaded():
    pods = [_pod("a", "base"), _pod("b", "base")]
    try:
        for p in pods:
            p.start()
        run, tok = _gateway(pods, ["base"])
        with run as gw:
            r = httpx.post(f"{pods[0].url}/v1/load_lora_adapter",
                           json={"lora_name": "sql", "lora_path": "/x"})  # fmt: skip
            assert r.status_code == 200
            wait_for(lambda: _chat(gw, "sql", "hi")[0] == 200, 15, what="sql served")
            for seed in range(3):
                system = text_of_tokens(200, seed=f"sql-{seed}", tokenizer_dir=tok)
                assert _chat(gw, "sql", system)[1] == "a"
                time.sleep(0.2)
                status, pod, predicted, cached = _chat(gw, "sql", system)
                assert (status, pod) == (200, "a") and cached > 0
                assert int(predicted) == cached
                # the adapter's cache is never the base model's
                assert _chat(gw, "base", system)[2:] == ("0", 0)
            assert 'model="sql"' in httpx.get(f"{gw}/metrics").text
            r = httpx.post(f"{pods[0].url}/v1/unload_lora_adapter", json={"lora_name": "sql"})
            assert r.status_code == 200

            def gone() -> bool:
                r = httpx.post(f"{gw}/v1/chat/completions", json={
                    "model": "sql", "messages": [{"role": "user", "content": "q"}]})  # fmt: skip
                return r.status_code == 404 and "Known models: base" in r.text

            wait_for(gone, 15, what="sql unknown")
            wait_for(lambda: 'model="sql"' not in httpx.get(f"{gw}/metrics").text, 15,
                     what="sql series gone")  # fmt: skip
    finally:
        for p in pods:
            p.stop()


def test_an_adapter_named_like_another_pods_base_model_does_not_take_its_requests():
    """Pod a loads an adapter named like the base model pod c serves. The name is
    taken as c's base model (docs/deploy.md, LoRA adapters), so its prompts are keyed
    as that model's; its requests also went to a, which served its adapter instead and
    whose cache was never predicted (was: pod a, predicted 0, cached 304)."""
    pods = [_pod("a", "base"), _pod("c", "other")]
    try:
        for p in pods:
            p.start()
        run, tok = _gateway(pods, ["base", "other"])
        with run as gw:
            r = httpx.post(f"{pods[0].url}/v1/load_lora_adapter",
                           json={"lora_name": "other", "lora_path": "/x"})  # fmt: skip
            assert r.status_code == 200

            def a_lists_it() -> bool:
                pod = httpx.get(f"{gw.admin}/admin/pods").json()["pods"][0]
                return "other" in pod["models"]

            wait_for(a_lists_it, 15, what="adapter learnt")
            system = text_of_tokens(300, seed="collide", tokenizer_dir=tok)
            for _ in range(3):
                status, pod, predicted, cached = _chat(gw, "other", system)
                assert (status, pod) == (200, "c")
                assert int(predicted) == cached
                time.sleep(0.2)
            assert cached > 0
    finally:
        for p in pods:
            p.stop()
