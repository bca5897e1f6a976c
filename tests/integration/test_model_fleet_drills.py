"""Fleet drills with several models: real simulated pods and a real gateway."""

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


def _chat(gw: str, model: str, system: str) -> tuple[int, str | None, int | None]:
    r = system_chat(gw, model, system)
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return r.status_code, r.headers.get("x-kvgate-predicted-cached-tokens"), cached


def _held(gw, model: str, system: str) -> dict:
    r = httpx.post(f"{gw.admin}/admin/index/lookup", json={"model": model, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "q"}]})  # fmt: skip
    return r.json().get("pods", {}) if r.status_code == 200 else {}


def test_a_pod_restarted_under_another_model_is_keyed_under_the_new_one():
    """A pod restarted on the same ports under another served name between two probes
    (never ejected): its events must be keyed under the new model, else the new
    model's cached prefixes are never predicted (was: predicted 0, pod cached 304)."""
    tok = str(ensure_tokenizer())
    pod = SimPod("x", {"model": "alpha", "block_size": 16, "default_max_tokens": 2},
                 {"kv_events": True})  # fmt: skip
    try:
        pod.start()
        spec = f"{pod.url},events={pod.events_endpoint},replay={pod.replay_endpoint}"
        models = {"alpha": {"block_size": 16, "tokenizer": tok},
                  "gamma": {"block_size": 16, "tokenizer": tok}}  # fmt: skip
        env = {"KVGATE_MODELS": json.dumps(models), "KVGATE_EXPOSE_PREDICTIONS": "true",
               "KVGATE_INDEX__SPECULATIVE_TTL_S": "0",
               # probes rare enough that the restart is never ejected (an ejection
               # re-follows the pod's events anyway)
               "KVGATE_HEALTH__INTERVAL_S": "3",
               "KVGATE_HEALTH__EJECT_AFTER_FAILED_PROBES": "100"}  # fmt: skip
        with run_gateway([("x", spec)], strategy="kv-aware", env=env, ready=False) as gw:
            wait_for(lambda: httpx.get(f"{gw}/v1/models").status_code == 200, 30, what="gw")
            system = text_of_tokens(300, seed=4, tokenizer_dir=tok)
            assert _chat(gw, "alpha", system)[0] == 200
            wait_for(lambda: _held(gw, "alpha", system), 10, what="alpha events")
            pod.stop()
            i = pod.args.index("--served-model-name")
            pod.args[i + 1] = "gamma"
            pod.start()

            def gamma_listed() -> bool:
                ids = [m["id"] for m in httpx.get(f"{gw}/v1/models").json()["data"]]
                return ids == ["gamma"]

            wait_for(gamma_listed, 15, what="gamma listed")
            assert httpx.post(f"{gw}/v1/chat/completions", json={
                "model": "alpha", "messages": [{"role": "user", "content": "hi"}]},
            ).status_code == 404  # fmt: skip
            assert _chat(gw, "gamma", system)[0] == 200
            wait_for(lambda: _held(gw, "gamma", system), 10, what="gamma events indexed")
            time.sleep(0.2)
            status, predicted, cached = _chat(gw, "gamma", system)
            assert status == 200 and cached > 0
            assert int(predicted) == cached
    finally:
        pod.stop()
