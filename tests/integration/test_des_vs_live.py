"""The discrete-event simulator agrees with a live run of the same small case.

Live: three simulated pods (subprocesses, KV events over ZMQ) behind a real
``kvgate serve``, driven open-loop over HTTP by ``bench.loadgen``. DES: the same
request sequence (token counts and block keys from the same tokenizer and chat
template), the same strategy objects and pod settings, in simulated time. TTFT p50
and the cached-token ratio must agree within 15%.
"""

import asyncio
import json
import random

import httpx
import pytest

from bench.des.sim import run_des
from bench.des.types import DesPodSpec
from bench.des.workload import chat_to_des
from bench.gateway_proc import run_gateway
from bench.loadgen import ChatRequest, run_open_loop
from bench.prompts import text_of_tokens
from bench.sim.config import SimConfig
from bench.sim.launch import sim_fleet
from bench.stats import percentile
from bench.tinymodel import MODEL_NAME, ensure_tokenizer

BS = 32
PODS = 3
# Slow enough that HTTP and gateway overhead (tens of ms on a busy 2-core machine)
# stays small next to the modelled times: cold ~0.58 s, warm ~0.41 s.
POD = dict(
    block_size=BS,
    overhead_s=0.4,
    prefill_tokens_per_s=5000.0,
    itl_s=0.01,
    max_num_seqs=4,
    l0_capacity_blocks=256,
)
# The same pods timed like CPU engines (``kvgate sim --prefill-ms-per-running
# --queued-overhead-share --step-phase-wait``): the live pod and the DES must agree on
# those terms too, the random step phase included (each draws its own).
CPU_POD = dict(POD, prefill_s_per_running=0.08, queued_overhead_share=0.25,
               step_phase_wait=True, itl_s=0.05)  # fmt: skip


def workload() -> list[ChatRequest]:
    tok_dir = ensure_tokenizer()
    systems = [text_of_tokens(800, seed=f"des-live-{g}", tokenizer_dir=tok_dir) for g in range(3)]
    rng = random.Random(5)
    out = []
    for i in range(15):
        question = text_of_tokens(30, seed=f"des-live-q{i}", tokenizer_dir=tok_dir)
        messages = [
            {"role": "system", "content": systems[rng.randrange(3)]},
            {"role": "user", "content": question},
        ]
        out.append(ChatRequest(messages=messages, max_tokens=4, at_s=0.35 * i))
    return out


def warm_up(gateway: str, request: ChatRequest) -> None:
    """Load the gateway's tokenizer (seconds, once) without routing anything."""
    body = {"model": MODEL_NAME, "messages": request.messages, "cache_salt": "warm-up"}
    assert (
        httpx.post(f"{gateway.admin}/admin/index/lookup", json=body, timeout=60).status_code == 200
    )


def live(strategy: str, requests: list[ChatRequest], pod: dict) -> tuple[float, float]:
    env = {
        "KVGATE_MODELS": json.dumps(
            {MODEL_NAME: {"block_size": BS, "tokenizer": str(ensure_tokenizer())}}
        )
    }
    with sim_fleet(PODS, kv_events=True, **pod) as pods:
        specs = [(p.name, f"{p.url},events={p.events_endpoint},replay={p.replay_endpoint}")
                 for p in pods]  # fmt: skip
        with run_gateway(specs, strategy=strategy, env=env) as gateway:
            warm_up(gateway, requests[0])
            results = asyncio.run(run_open_loop(gateway, MODEL_NAME, requests, label=strategy))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    ttft = percentile([r.ttft_s for r in results], 50)
    cached = sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results)
    return ttft, cached


def simulated(strategy: str, requests: list[ChatRequest], pod: dict) -> tuple[float, float]:
    cfg = SimConfig(**pod)
    des_requests = chat_to_des(
        [r.messages for r in requests],
        [r.max_tokens for r in requests],
        [r.at_s for r in requests],
        ensure_tokenizer(),
        MODEL_NAME,
        BS,
    )
    spec = DesPodSpec(
        timing=cfg.timing(),
        block_size=BS,
        l0_capacity_blocks=cfg.l0_capacity_blocks,
        max_num_seqs=cfg.max_num_seqs,
        prefill_concurrency=cfg.prefill_concurrency,
    )
    results = run_des(des_requests, PODS, strategy, spec, event_delay_s=0.005,
                      scrape_interval_s=0.5)  # fmt: skip
    ttft = percentile([r.ttft_s for r in results], 50)
    cached = sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results)
    return ttft, cached


@pytest.mark.parametrize(
    ("strategy", "pod"),
    [("round-robin", POD), ("kv-aware", POD), ("kv-aware", CPU_POD)],
    ids=["round-robin", "kv-aware", "kv-aware-cpu-steps"],
)
def test_des_ttft_p50_and_cached_ratio_match_a_live_run_within_15_percent(strategy, pod):
    requests = workload()
    live_ttft, live_cached = live(strategy, requests, pod)
    des_ttft, des_cached = simulated(strategy, requests, pod)
    print(f"{strategy}: live p50 {live_ttft:.3f}s cached {live_cached:.3f}; "
          f"DES p50 {des_ttft:.3f}s cached {des_cached:.3f}")  # fmt: skip
    assert des_ttft == pytest.approx(live_ttft, rel=0.15)
    assert des_cached == pytest.approx(live_cached, rel=0.15)
