"""Hot reload of a real ``kvgate serve --config`` process in front of simulated pods:
SIGHUP (to the one process, or to the supervisor of ``--workers 2``), a config file
replaced the way Kubernetes updates a mounted ConfigMap, and ``POST /admin/reload``."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bench.gateway_proc import GatewayURL, run_gateway
from bench.polling import wait_for
from bench.prompts import text_of_tokens
from bench.sim.launch import SimPod, sim_fleet
from bench.tinymodel import MODEL_NAME, ensure_tokenizer

MODEL = MODEL_NAME
BLOCK = 32
LONG_ANSWER = 400  # tokens of a stream that outlives the reload (4 ms each)


@pytest.fixture(scope="module")
def fleet():
    with sim_fleet(2, kv_events=True, block_size=BLOCK, itl_s=0.004,
                   default_max_tokens=2) as pods:  # fmt: skip
        yield pods


@pytest.fixture(scope="module")
def system_prompt() -> str:
    return text_of_tokens(500, seed=11, tokenizer_dir=ensure_tokenizer())


def pod(p: SimPod) -> dict[str, Any]:
    return {"name": p.name, "url": p.url, "kv_events": p.events_endpoint,
            "kv_replay": p.replay_endpoint}  # fmt: skip


def config(pods: list[SimPod], **settings: Any) -> dict[str, Any]:
    model = {"block_size": BLOCK, "tokenizer": str(ensure_tokenizer())}
    return {"pods": [pod(p) for p in pods], "models": {MODEL: model}, "strategy": "kv-aware",
            "expose_predictions": True, **settings}  # fmt: skip


def write(path: Path, settings: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")  # written whole, then renamed: no reader sees half
    tmp.write_text(yaml.safe_dump(settings))
    tmp.replace(path)


def reloads(gw: str, result: str) -> float:
    """``kvgate_config_reloads_total{result=...}`` (summed over workers)."""
    for line in httpx.get(f"{gw}/metrics").text.splitlines():
        if line.startswith(f'kvgate_config_reloads_total{{result="{result}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_reloads(gw: str, result: str, n: float) -> None:
    wait_for(lambda: reloads(gw, result) >= n, 10, what=f"{n:g} reloads {result}", poll=0.05)


def chat(gw: str, key: str | None, content: str, system: str = "") -> httpx.Response:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    with httpx.Client(timeout=30) as client:  # a connection of its own: any worker
        return client.post(f"{gw}/v1/chat/completions", headers=headers, json=body)


def long_stream(gw: str, key: str) -> tuple[int, str, str | None, bool]:
    """Status, strategy, the last choice's finish reason and whether [DONE] ended it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell a long story"}],
            "max_tokens": LONG_ANSWER, "stream": True}  # fmt: skip
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{gw}/v1/chat/completions", json=body, headers=headers,
                      timeout=30) as r:  # fmt: skip
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    finish = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    return r.status_code, r.headers["x-kvgate-strategy"], finish[-1], events[-1] == "[DONE]"


def holders(gw: GatewayURL, system: str) -> dict[str, int]:
    """L0 blocks of ``system``'s prompt per pod, as the index says (admin lookup)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "x"}]
    r = httpx.post(f"{gw.admin}/admin/index/lookup", json={"model": MODEL, "messages": messages})
    return {p: v["l0_blocks"] for p, v in r.json()["pods"].items()}


def test_sighup_rotates_keys_and_strategy_keeps_the_index_and_a_stream_from_before_completes(
    fleet, system_prompt, tmp_path
):
    a = fleet[0]
    path = tmp_path / "kvgate.yaml"
    write(path, config([a], api_keys=["key-1"]))
    with run_gateway([], strategy=None, extra_args=["--config", str(path)]) as gw:
        assert chat(gw, "key-1", "q0", system_prompt).status_code == 200
        wait_for(lambda: holders(gw, system_prompt).get(a.name, 0) >= 15, 10,
                 what="the prompt's KV events in the index")  # fmt: skip
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(long_stream, gw, "key-1")
            time.sleep(0.3)  # the stream is under way
            write(path, config([a], api_keys=["key-2"], strategy="least-loaded"))
            os.kill(gw.pid, signal.SIGHUP)
            wait_reloads(gw, "applied", 1)
            assert not stream.done()  # the reload happened while it streamed
            streamed = stream.result(timeout=10)

        old_key = chat(gw, "key-1", "q1", system_prompt)
        after = chat(gw, "key-2", "q2", system_prompt)
        held = holders(gw, system_prompt)

    assert streamed == (200, "kv-aware", "length", True)  # all LONG_ANSWER tokens
    assert old_key.status_code == 401
    assert (after.status_code, after.headers["x-kvgate-strategy"]) == (200, "least-loaded")
    assert held[a.name] >= 15  # the index kept what the pod holds


def test_a_reload_moves_traffic_to_added_pods_and_a_broken_config_is_rejected(fleet, tmp_path):
    a, b = fleet
    path = tmp_path / "kvgate.yaml"
    write(path, config([a], strategy="round-robin"))
    with run_gateway([], strategy=None, extra_args=["--config", str(path)]) as gw:
        before = {chat(gw, None, f"before {i}").headers["x-kvgate-pod"] for i in range(4)}
        write(path, config([b], strategy="round-robin"))
        os.kill(gw.pid, signal.SIGHUP)
        wait_reloads(gw, "applied", 1)
        after = {chat(gw, None, f"after {i}").headers["x-kvgate-pod"] for i in range(4)}

        path.write_text("strategy: round-robin\npods: [\n")  # a typo
        os.kill(gw.pid, signal.SIGHUP)
        wait_reloads(gw, "rejected", 1)
        still = {chat(gw, None, f"still {i}").headers["x-kvgate-pod"] for i in range(4)}
        log = gw.log.read_text() if gw.log else ""

    assert (before, after, still) == ({a.name}, {b.name}, {b.name})
    assert "config reload (SIGHUP) rejected, the running settings stay: bad YAML" in log


def test_every_worker_reloads_on_sighup_to_the_supervisor_and_on_post_admin_reload(fleet, tmp_path):
    a = fleet[0]
    path = tmp_path / "kvgate.yaml"
    write(path, config([a], strategy="round-robin", api_keys=["key-1"]))
    with run_gateway([], strategy=None, extra_args=["--config", str(path)], workers=2) as gw:
        write(path, config([a], strategy="round-robin", api_keys=["key-2"]))
        os.kill(gw.pid, signal.SIGHUP)
        wait_reloads(gw, "applied", 2)  # one per worker
        by_sighup = [chat(gw, "key-2", f"q{i}") for i in range(12)]
        refused = [chat(gw, "key-1", f"q{i}").status_code for i in range(6)]

        write(path, config([a], strategy="round-robin", api_keys=["key-3"]))
        answer = httpx.post(f"{gw.admin}/admin/reload").json()
        wait_reloads(gw, "applied", 4)
        by_post = [chat(gw, "key-3", f"q{i}") for i in range(12)]

    assert answer == {"result": "applied", "changed": ["api_keys"], "needs_restart": []}
    for answers in (by_sighup, by_post):
        assert {r.status_code for r in answers} == {200}
        assert {r.headers["x-kvgate-worker"] for r in answers} == {"0", "1"}
    assert set(refused) == {401}


def test_a_configmap_update_by_symlink_swap_is_seen_and_applied(fleet, tmp_path):
    """A mounted ConfigMap: ``config.yaml`` links into ``..data``, which links to a
    timestamped directory; the kubelet writes a new directory and swaps ``..data``."""
    a, b = fleet
    for version, pods in (("..2025_01_01", [a]), ("..2025_01_02", [b])):
        (tmp_path / version).mkdir()
        write(tmp_path / version / "config.yaml", config(pods, strategy="round-robin"))
    (tmp_path / "..data").symlink_to("..2025_01_01")
    (tmp_path / "config.yaml").symlink_to("..data/config.yaml")
    env = {"KVGATE_RELOAD__WATCH_INTERVAL_S": "0.2"}
    args = ["--config", str(tmp_path / "config.yaml")]
    with run_gateway([], strategy=None, extra_args=args, env=env) as gw:
        before = chat(gw, None, "before").headers["x-kvgate-pod"]
        (tmp_path / "..data_tmp").symlink_to("..2025_01_02")
        (tmp_path / "..data_tmp").replace(tmp_path / "..data")
        wait_reloads(gw, "applied", 1)
        after = chat(gw, None, "after").headers["x-kvgate-pod"]

    assert (before, after) == (a.name, b.name)
