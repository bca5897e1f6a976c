"""A pod restarted on its ports between two health probes (a container restart the
gateway never ejects): its index entries must go as soon as a probe sees the new
process, not when the restarted pod first publishes an event.

Real simulated pod, real gateway. Without the restart signal the idle restarted pod
kept every entry of the old process for as long as it published nothing, and
kv-aware predicted 288 cached tokens for a prompt the pod reported 0 for."""

from __future__ import annotations

import json
import time

import httpx

from bench.gateway_proc import GatewayURL, run_gateway
from bench.polling import wait_for
from bench.prompts import text_of_tokens
from bench.sim.launch import SimPod
from bench.tinymodel import MODEL_NAME, ensure_tokenizer
from tests.sim_gateway import BLOCK, pod_spec, system_chat

PROBE_INTERVAL_S = 1.0
# A restart is seen by the first probe that reaches the new process: at most one
# interval after it serves, plus the probe itself and the re-follow.
DETECTED_WITHIN_S = 2 * PROBE_INTERVAL_S + 2.0


def _chat(gw: GatewayURL, system: str) -> tuple[int, int]:
    """(predicted cached tokens, cached tokens the pod reported) for one chat."""
    r = system_chat(gw, MODEL_NAME, system)
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(r.headers["x-kvgate-predicted-cached-tokens"]), cached


def _held_blocks(gw: GatewayURL, pod: str, system: str) -> int:
    """The L0 blocks the gateway's index says ``pod`` holds of the chat's prompt."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
    r = httpx.post(f"{gw.admin}/admin/index/lookup",
                   json={"model": MODEL_NAME, "messages": messages}, timeout=10)  # fmt: skip
    assert r.status_code == 200, r.text
    return int(r.json().get("pods", {}).get(pod, {}).get("l0_blocks", 0))


def _env() -> dict[str, str]:
    model = {"block_size": BLOCK, "tokenizer": str(ensure_tokenizer())}
    return {
        "KVGATE_MODELS": json.dumps({MODEL_NAME: model}),
        "KVGATE_EXPOSE_PREDICTIONS": "true",
        "KVGATE_INDEX__SPECULATIVE_TTL_S": "0",  # only the pod's events fill the index
        "KVGATE_HEALTH__INTERVAL_S": str(PROBE_INTERVAL_S),
        # A restart between probes is never ejected (an ejection re-follows anyway).
        "KVGATE_HEALTH__EJECT_AFTER_FAILED_PROBES": "1000",
        "KVGATE_HEALTH__EJECT_AFTER_FAILED_REQUESTS": "1000",
    }


def test_an_idle_pod_restarted_between_probes_loses_its_index_entries_at_the_next_probe():
    pod = SimPod("sim-0", {"block_size": BLOCK, "itl_s": 0.001, "default_max_tokens": 2},
                 {"kv_events": True})  # fmt: skip
    try:
        pod.start()
        with run_gateway([pod_spec(pod, replay=True)], "kv-aware", env=_env()) as gw:
            system = text_of_tokens(300, seed=11, tokenizer_dir=str(ensure_tokenizer()))
            _chat(gw, system)
            held = wait_for(lambda: _held_blocks(gw, pod.name, system), 10, what="events")
            # A pod that keeps its process keeps its entries, probe after probe.
            time.sleep(3 * PROBE_INTERVAL_S)
            assert _held_blocks(gw, pod.name, system) == held
            predicted, cached = _chat(gw, system)
            assert predicted == cached > 0

            pod.kill()  # a crash, and the container back on the same ports at once
            pod.start()
            back = time.monotonic()
            wait_for(lambda: _held_blocks(gw, pod.name, system) == 0, DETECTED_WITHIN_S,
                     what="the old process's entries dropped")  # fmt: skip
            dropped_after = time.monotonic() - back
            assert dropped_after < DETECTED_WITHIN_S

            predicted, cached = _chat(gw, system)
            assert (predicted, cached) == (0, 0)
            # ... and the new process's events are followed: its cache is predicted again.
            wait_for(lambda: _held_blocks(gw, pod.name, system), 10, what="new events")
            predicted, cached = _chat(gw, system)
            assert predicted == cached > 0
    finally:
        pod.stop()
