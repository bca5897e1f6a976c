"""kv-aware and prefix-aware routing through the gateway, fed by simulated pods' events."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from bench.gateway_proc import run_gateway
from bench.polling import wait_for
from bench.prompts import text_of_tokens
from bench.sim.launch import sim_fleet
from bench.tinymodel import ensure_tokenizer
from tests.readme_metrics import readme_metric_names

MODEL = "kvgate-tiny-llama"
BLOCK = 32


def _spec(pod) -> str:
    return f"{pod.url},events={pod.events_endpoint},replay={pod.replay_endpoint}"


def _env(local_tokenizer: bool) -> dict[str, str]:
    model = {"block_size": BLOCK}
    if local_tokenizer:
        model["tokenizer"] = str(ensure_tokenizer())
    # the tests read the x-kvgate-predicted-* headers
    return {"KVGATE_MODELS": json.dumps({MODEL: model}), "KVGATE_EXPOSE_PREDICTIONS": "true"}


@pytest.fixture(scope="module")
def fleet():
    with sim_fleet(2, kv_events=True, block_size=BLOCK, itl_s=0.001, default_max_tokens=4) as p:
        yield p


@pytest.fixture(scope="module")
def system_prompt() -> str:
    return text_of_tokens(900, seed=7, tokenizer_dir=ensure_tokenizer())


def _chat(client, system: str, question: str):
    return client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
    )


def _lookup(gateway: str, messages: list[dict], **extra) -> dict:
    r = httpx.post(
        f"{gateway.admin}/admin/index/lookup", json={"model": MODEL, "messages": messages, **extra}
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("local_tokenizer", [True, False], ids=["local-tokenizer", "engine"])
def test_kv_aware_sends_a_shared_system_prompt_to_the_pod_holding_it(
    fleet, system_prompt, local_tokenizer
):
    with run_gateway(
        [(p.name, _spec(p)) for p in fleet], strategy="kv-aware", env=_env(local_tokenizer)
    ) as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="x", max_retries=0)
        salt = "local" if local_tokenizer else "engine"  # each run starts cold
        first = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": "q0"},
            ],
            max_tokens=4,
            extra_body={"cache_salt": salt},
        )
        home = first.headers["x-kvgate-pod"]
        for i in range(1, 6):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": system_prompt},
                    {"role": "user", "content": f"question number {i}?"},
                ],
                max_tokens=4,
                extra_body={"cache_salt": salt},
            )
            usage = raw.parse().usage
            assert raw.headers["x-kvgate-pod"] == home
            assert int(raw.headers["x-kvgate-predicted-cached-tokens"]) == (
                usage.prompt_tokens_details.cached_tokens
            )
            assert usage.prompt_tokens_details.cached_tokens >= 800


def test_index_lookup_shows_the_pod_that_served_a_prompt(fleet, system_prompt):
    with run_gateway(
        [(p.name, _spec(p)) for p in fleet], strategy="round-robin", env=_env(True)
    ) as gw:
        messages = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": "lookup me"},
        ]
        raw = httpx.post(
            f"{gw}/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 2, "cache_salt": "lk"},
        )
        pod = raw.headers["x-kvgate-pod"]
        other = next(p.name for p in fleet if p.name != pod)
        found = wait_for(lambda: _lookup(gw, messages, cache_salt="lk")["pods"].get(pod), 5)
        d = _lookup(gw, messages, cache_salt="lk")
        assert found["l0_blocks"] == d["full_blocks"] == d["prompt_tokens"] // BLOCK
        assert other not in d["pods"]
        # Without the salt the same messages are a different cache entry.
        assert _lookup(gw, messages)["pods"].get(pod) is None

        out = subprocess.run(
            [sys.executable, "-m", "cli", "index", "--gateway", gw.admin, "--json", "lookup",
             "--model", MODEL, "--messages", json.dumps(messages), "--cache-salt", "lk"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert json.loads(out.stdout)["pods"][pod]["l0_blocks"] == d["full_blocks"]
        stats = subprocess.run(
            [sys.executable, "-m", "cli", "index", "--gateway", gw.admin, "stats"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert pod in stats.stdout and "backend memory" in stats.stdout
        # kv-aware's eviction price reads each pod's L0 size (scraped from the pod's
        # vllm:cache_config_info, the simulator's default 4,096 blocks) and occupancy.
        l0 = wait_for(
            lambda: (
                (r := httpx.get(f"{gw.admin}/admin/index/stats").json()["l0"])
                and r[pod]["capacity_blocks"]
                and r
            ),
            5,
        )
        assert {name: e["capacity_blocks"] for name, e in l0.items()} == {
            p.name: 4096 for p in fleet
        }
        assert l0[pod]["held_blocks"] >= d["full_blocks"]


def test_prefix_aware_keeps_a_shared_prompt_on_one_pod_without_events(fleet, system_prompt):
    with run_gateway(
        [(p.name, p.url) for p in fleet], strategy="prefixaware"
    ) as gw:  # no events, no tokenizer: approximate affinity only
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="x", max_retries=0)
        pods = {
            _chat(client, system_prompt + " prefix-aware run", f"q{i}").headers["x-kvgate-pod"]
            for i in range(5)
        }
        assert len(pods) == 1


def test_session_strategy_keeps_a_user_on_one_pod(fleet):
    with run_gateway([(p.name, p.url) for p in fleet], strategy="session") as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="x", max_retries=0)
        for user in ("alice", "bob", "carol"):
            pods = {
                client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], user=user
                ).headers["x-kvgate-pod"]
                for i in range(4)
            }
            assert len(pods) == 1


def test_kv_events_over_http_are_accepted_and_garbage_is_a_400(fleet):
    with run_gateway([(p.name, p.url) for p in fleet], env=_env(True)) as gw:
        tokens = list(range(1, 2 * BLOCK + 1))
        batch = [time.time(), [{"type": "BlockStored", "block_hashes": [11, 12],
                 "parent_block_hash": None, "token_ids": tokens, "block_size": BLOCK,
                 "lora_id": None, "medium": "GPU", "lora_name": None}], None]  # fmt: skip
        r = httpx.post(
            f"{gw.admin}/admin/kv-events?pod={fleet[0].name}",
            content=json.dumps(batch),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 200 and r.json()["applied_ops"] >= 1
        d = httpx.post(
            f"{gw.admin}/admin/index/lookup", json={"model": MODEL, "prompt": tokens}
        ).json()
        assert d["pods"][fleet[0].name]["l0_blocks"] == 2
        bad = httpx.post(
            f"{gw.admin}/admin/kv-events?pod={fleet[0].name}",
            content=b"\xc1\xff garbage",
            headers={"content-type": "application/msgpack"},
        )
        assert bad.status_code == 400 and "error" in bad.json()
        assert httpx.post(f"{gw.admin}/admin/kv-events?pod=nope", content=b"[]").status_code == 404


def test_every_metric_in_the_readme_is_exported(fleet, system_prompt):
    names = readme_metric_names()
    assert len(names) >= 25
    with run_gateway(
        [(p.name, _spec(p)) for p in fleet], strategy="kv-aware", env=_env(True)
    ) as gw:
        client = openai.OpenAI(base_url=f"{gw}/v1", api_key="x", max_retries=0)
        _chat(client, system_prompt, "metrics please")
        wait_for(lambda: "kvgate_kv_events_applied_total{" in httpx.get(f"{gw}/metrics").text, 5)
        exported = httpx.get(f"{gw}/metrics").text
    declared = {line.split()[2] for line in exported.splitlines() if line.startswith("# TYPE ")}
    redis_only = {n for n in names if "redis" in n or "fallbacks" in n or "fleet_load" in n}
    # Admission control's exist only with it on (tests/inproc/test_admission.py checks them).
    admission_only = {n for n in names if n.startswith("kvgate_admission_")}
    # The workers' exist only with --workers > 1 (tests/integration/test_scale_out.py).
    workers_only = {n for n in names if n.startswith("kvgate_worker_")}
    missing = sorted(n for n in names - redis_only - admission_only - workers_only
                     if n not in declared)  # fmt: skip
    assert missing == []
