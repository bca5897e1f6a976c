"""Gateway overhead: latency added by kvgate versus calling the pod directly.

One simulated pod with zero modelled latency (no prefill or decode time), so what
remains is HTTP, parsing and tokenization on both paths. Direct and gateway
requests alternate in one run, and the overhead is the per-pair difference, which
cancels drift in the machine's speed. Then a closed loop at some concurrency
measures requests/s through the gateway and directly.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.prompts import text_of_tokens
from bench.stats import percentile


@dataclass(frozen=True)
class OverheadResult:
    prompt_tokens: int
    pairs: int
    direct_p50_ms: float
    direct_p99_ms: float
    gateway_p50_ms: float
    gateway_p99_ms: float
    overhead_p50_ms: float
    overhead_p99_ms: float
    concurrency: int
    direct_rps: float
    gateway_rps: float


async def _timed_post(client: httpx.AsyncClient, url: str, body: dict) -> float:
    started = time.perf_counter()
    r = await client.post(url, json=body)
    r.raise_for_status()
    return time.perf_counter() - started


async def _closed_loop(
    client: httpx.AsyncClient, url: str, body: dict, concurrency: int, seconds: float
) -> float:
    done = 0
    deadline = time.perf_counter() + seconds

    async def user() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await _timed_post(client, url, body)
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(concurrency)))
    return done / (time.perf_counter() - started)


async def measure_overhead(
    pod_url: str,
    gateway_url: str,
    model: str,
    prompt: str,
    prompt_tokens: int,
    pairs: int = 300,
    concurrency: int = 8,
    seconds: float = 5.0,
) -> OverheadResult:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    direct_url = f"{pod_url}/v1/chat/completions"
    gw_url = f"{gateway_url}/v1/chat/completions"
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        for _ in range(20):  # warm connections, caches and code paths
            await _timed_post(client, direct_url, body)
            await _timed_post(client, gw_url, body)
        direct: list[float] = []
        via: list[float] = []
        with Progress(transient=True) as progress:
            task = progress.add_task("paired requests", total=pairs)
            for i in range(pairs):
                # Alternate which goes first so neither path always sees a warmer pod.
                if i % 2:
                    via.append(await _timed_post(client, gw_url, body))
                    direct.append(await _timed_post(client, direct_url, body))
                else:
                    direct.append(await _timed_post(client, direct_url, body))
                    via.append(await _timed_post(client, gw_url, body))
                progress.advance(task)
        diffs = [(g - d) * 1000 for g, d in zip(via, direct, strict=True)]
        direct_rps = await _closed_loop(client, direct_url, body, concurrency, seconds)
        gateway_rps = await _closed_loop(client, gw_url, body, concurrency, seconds)
    ms = [d * 1000 for d in direct]
    gs = [g * 1000 for g in via]
    return OverheadResult(
        prompt_tokens=prompt_tokens,
        pairs=pairs,
        direct_p50_ms=percentile(ms, 50),
        direct_p99_ms=percentile(ms, 99),
        gateway_p50_ms=percentile(gs, 50),
        gateway_p99_ms=percentile(gs, 99),
        overhead_p50_ms=percentile(diffs, 50),
        overhead_p99_ms=percentile(diffs, 99),
        concurrency=concurrency,
        direct_rps=direct_rps,
        gateway_rps=gateway_rps,
    )


def print_overhead(result: OverheadResult, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"Gateway overhead, {result.prompt_tokens}-token chat prompts")
    for col in ("path", "p50 ms", "p99 ms", f"req/s @ {result.concurrency} users"):
        table.add_column(col, justify="right" if col != "path" else "left")
    table.add_row(
        "direct to pod",
        f"{result.direct_p50_ms:.2f}",
        f"{result.direct_p99_ms:.2f}",
        f"{result.direct_rps:.0f}",
    )
    table.add_row(
        "through kvgate",
        f"{result.gateway_p50_ms:.2f}",
        f"{result.gateway_p99_ms:.2f}",
        f"{result.gateway_rps:.0f}",
    )
    table.add_row(
        "added by kvgate (paired)",
        f"{result.overhead_p50_ms:.2f}",
        f"{result.overhead_p99_ms:.2f}",
        "",
    )
    console.print(table)


def run_overhead_bench(
    prompt_tokens: int = 2000,
    pairs: int = 300,
    concurrency: int = 8,
    seconds: float = 5.0,
    strategy: str = "round-robin",
) -> OverheadResult:
    from bench.gateway_proc import run_gateway
    from bench.sim.launch import sim_fleet
    from bench.tinymodel import MODEL_NAME, ensure_tokenizer

    prompt = text_of_tokens(prompt_tokens, seed=1, tokenizer_dir=ensure_tokenizer())
    zero_latency = {
        "overhead_s": 0.0,
        "itl_s": 0.0,
        "prefill_tokens_per_s": 1e12,
        "default_max_tokens": 1,
        "max_model_len": max(4096, prompt_tokens * 2),
    }
    # Strategies that use the index tokenize locally with the pods' own tokenizer, as
    # a production config would (engine mode would add a /tokenize round trip).
    models = {MODEL_NAME: {"block_size": 32, "tokenizer": str(ensure_tokenizer())}}
    with (
        sim_fleet(1, kv_events=True, **zero_latency) as pods,
        run_gateway(
            [(pods[0].name, f"{pods[0].url},events={pods[0].events_endpoint}")],
            strategy=strategy,
            env={"KVGATE_MODELS": json.dumps(models)},
        ) as gateway,
    ):
        return asyncio.run(
            measure_overhead(
                pods[0].url, gateway, MODEL_NAME, prompt, prompt_tokens, pairs, concurrency, seconds
            )
        )
