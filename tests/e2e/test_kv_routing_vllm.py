"""kvgate's index and kv-aware routing against two real vLLM pods (issues 3 and 4).

The gateway tokenizes with the pods' own tokenizer directory (local mode), keys
blocks itself, and learns what each pod holds from the pods' real ZMQ KV events.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import zmq
from openai import OpenAI

from bench.gateway_proc import GatewayURL, run_gateway
from bench.polling import wait_for
from bench.vllm_pods import BLOCK_SIZE, MODEL_NAME, VllmServer
from kvindex.events.ingest import PodIngestor
from kvindex.keyer import BlockKeyer
from kvindex.store import Stored
from kvindex.types import Tier
from tests.e2e.prompts import prompt_text
from tests.recording_store import RecordingStore

POD_NAMES = ("pod-a", "pod-b")


def _pods(vllm_pods: list[VllmServer]) -> list[tuple[str, str]]:
    return [
        (name, f"{p.url},events={p.events_endpoint},replay={p.replay_endpoint}")
        for name, p in zip(POD_NAMES, vllm_pods, strict=True)
    ]


def _env(tokenizer_dir) -> dict[str, str]:
    models = {MODEL_NAME: {"block_size": BLOCK_SIZE, "tokenizer": str(tokenizer_dir)}}
    return {"KVGATE_MODELS": json.dumps(models), "KVGATE_EXPOSE_PREDICTIONS": "true"}


@pytest.fixture(scope="module")
def rr_gateway(vllm_pods, tiny_tokenizer_dir) -> Iterator[GatewayURL]:
    with run_gateway(_pods(vllm_pods), "round-robin", env=_env(tiny_tokenizer_dir)) as url:
        yield url


def _index_lookup_cli(gateway: GatewayURL, body: dict) -> dict:
    cmd = [sys.executable, "-m", "cli", "index", "--gateway", gateway.admin, "--json",
           "lookup", "--model", MODEL_NAME]  # fmt: skip
    if "messages" in body:
        cmd += ["--messages", json.dumps(body["messages"])]
    else:
        cmd += ["--prompt", body["prompt"]]
    if body.get("cache_salt"):
        cmd += ["--cache-salt", body["cache_salt"]]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def _router_keys_from_events(frames: list[list[bytes]], pod: str) -> list[int]:
    """Replay the pod's own event frames through kvindex: the L0 keys it learnt, in order."""
    store = RecordingStore()
    ingestor = PodIngestor(pod, BlockKeyer(MODEL_NAME, BLOCK_SIZE), store)

    async def feed() -> None:
        for frame in frames:
            await ingestor.apply_payload(frame[2])

    asyncio.run(feed())
    return [k for op in store.ops(pod) if isinstance(op, Stored) and op.tier == Tier.L0
            for k in op.keys]  # fmt: skip


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_index_shows_the_serving_pod_and_keys_equal_those_learnt_from_its_events(
    rr_gateway, vllm_pods, nonce, kind, salt
):
    text = prompt_text(nonce, 250)
    body: dict = {"model": MODEL_NAME, "max_tokens": 2}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if salt:
        body["cache_salt"] = salt

    ctx = zmq.Context.instance()
    subs = {}
    for name, pod in zip(POD_NAMES, vllm_pods, strict=True):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pod.events_endpoint)
        subs[name] = sub
    time.sleep(0.5)  # let the SUB sockets join before the request
    try:
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        r = httpx.post(rr_gateway + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        pod_a = r.headers["x-kvgate-pod"]
        pod_b = next(n for n in POD_NAMES if n != pod_a)

        def held_by_pod_a() -> dict | None:
            seen = _index_lookup_cli(rr_gateway, body)
            whole = seen["pods"].get(pod_a, {}).get("l0_blocks") == seen["full_blocks"]
            return seen if whole else None

        seen = wait_for(held_by_pod_a, timeout=10, what=f"{pod_a} to hold it all in L0", poll=0.2)
        assert seen["full_blocks"] == seen["prompt_tokens"] // BLOCK_SIZE > 5
        assert seen["pods"][pod_a] == {
            "l0_blocks": seen["full_blocks"],
            "l0_l1_blocks": seen["full_blocks"],
        }
        assert pod_b not in seen["pods"]

        frames = []
        while subs[pod_a].poll(200):
            frames.append(subs[pod_a].recv_multipart())
        learnt = _router_keys_from_events(frames, pod_a)
        gateway_keys = [int(k, 16) for k in seen["keys"]]
        assert learnt[: len(gateway_keys)] == gateway_keys
    finally:
        for sub in subs.values():
            sub.close(linger=0)


def test_the_gateway_reads_each_pods_l0_size_and_counts_what_its_events_put_there(
    rr_gateway, vllm_pods, nonce
):
    # vLLM exports its KV cache size as the num_gpu_blocks label of
    # vllm:cache_config_info (on CPU too); kv-aware's eviction price needs it.
    exported = {}
    for name, pod in zip(POD_NAMES, vllm_pods, strict=True):
        text = httpx.get(f"{pod.url}/metrics", timeout=10).text
        line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
        exported[name] = int(line.split('num_gpu_blocks="', 1)[1].split('"', 1)[0])
    body = {"model": MODEL_NAME, "prompt": prompt_text(nonce, 300), "max_tokens": 2}
    r = httpx.post(rr_gateway + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    served = r.headers["x-kvgate-pod"]
    full_blocks = r.json()["usage"]["prompt_tokens"] // BLOCK_SIZE

    def stats() -> dict | None:
        l0 = httpx.get(f"{rr_gateway.admin}/admin/index/stats", timeout=10).json()["l0"]
        ready = all(l0[n]["capacity_blocks"] for n in POD_NAMES)
        return l0 if ready and (l0[served]["held_blocks"] or 0) >= full_blocks else None

    l0 = wait_for(stats, timeout=10, what="capacity scraped and the prompt's blocks counted")
    assert {n: e["capacity_blocks"] for n, e in l0.items()} == exported
    assert all(blocks > full_blocks for blocks in exported.values())


def _ask(client: OpenAI, system: str, question: str):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=2,
    )
    usage = raw.parse().usage
    return raw.headers, usage.prompt_tokens_details.cached_tokens


QUESTIONS = [f"question {i}: what does block {i} hold?" for i in range(6)]


def _run_sequence(gateway: str, system: str) -> list[tuple[str, int, int | None]]:
    client = OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0)
    out = []
    for q in QUESTIONS:
        headers, cached = _ask(client, system, q)
        predicted = headers.get("x-kvgate-predicted-cached-tokens")
        out.append((headers["x-kvgate-pod"], cached, int(predicted) if predicted else None))
    return out


def test_kv_aware_follows_the_cache_and_predicts_cached_tokens_exactly(
    vllm_pods, tiny_tokenizer_dir, nonce, rr_gateway
):
    system = prompt_text(nonce, 400)
    with run_gateway(_pods(vllm_pods), "kv-aware", env=_env(tiny_tokenizer_dir)) as gw:
        kv = _run_sequence(gw, system)
    pods = [p for p, _, _ in kv]
    assert len(set(pods)) == 1, pods
    for _pod, cached, predicted in kv:
        assert predicted == cached, kv
    assert all(cached > 300 for _, cached, _ in kv[1:])

    rr = _run_sequence(rr_gateway, prompt_text(nonce + "-rr", 400))
    assert len({p for p, _, _ in rr}) == 2
    assert sum(c for _, c, _ in rr) < sum(c for _, c, _ in kv)


def test_prefix_aware_keeps_the_shared_system_prompt_on_one_pod(vllm_pods, nonce):
    system = prompt_text(nonce, 400)
    with run_gateway(_pods(vllm_pods), "prefix-aware") as gw:
        seq = _run_sequence(gw, system)
    assert len({p for p, _, _ in seq}) == 1, seq
    assert all(cached > 300 for _, cached, _ in seq[1:])


def test_token_ids_sent_as_floats_are_keyed_like_the_ints_vllm_reads(
    vllm_pods, tiny_tokenizer_dir, nonce
):
    """vLLM reads ``[1.0, 2.0]`` as token ids 1 and 2; so does the index."""
    text = prompt_text(nonce, 300)
    tokenized = httpx.post(f"{vllm_pods[0].url}/tokenize",
                           json={"model": MODEL_NAME, "prompt": text}, timeout=30)  # fmt: skip
    ids = tokenized.json()["tokens"]
    seen = []
    with run_gateway(_pods(vllm_pods), "kv-aware", env=_env(tiny_tokenizer_dir)) as gw:
        client = OpenAI(base_url=f"{gw}/v1", api_key="x", max_retries=0)
        for _ in range(3):
            raw = client.completions.with_raw_response.create(
                model=MODEL_NAME, prompt=[float(t) for t in ids], max_tokens=1
            )
            cached = raw.parse().usage.prompt_tokens_details.cached_tokens
            predicted = int(raw.headers["x-kvgate-predicted-cached-tokens"])
            seen.append((raw.headers["x-kvgate-pod"], predicted, cached))
    full = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert len({pod for pod, _, _ in seen}) == 1, seen
    assert [(p, c) for _, p, c in seen] == [(0, 0), (full, full), (full, full)], seen
