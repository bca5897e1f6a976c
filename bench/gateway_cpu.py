"""A gateway's CPU per request at a modest open-loop rate, in front of simulated pods.

    python -m bench.gateway_cpu --strategy round-robin --rate 32 --max-tokens 16

The overhead benchmark (``kvgate bench overhead``) measures a saturated gateway, where
the event loop serves many requests per wake-up. A fleet of CPU pods is served at tens
of requests a second, where every upstream chunk, client write and KV event wakes the
loop on its own; what a request costs there is what the gateway takes from pods that
share its cores (``kvgate bench real`` runs both on this machine's two cores). This
starts two simulated pods (KV events on unless ``--no-events``) and one gateway, sends
the real-fleet benchmark's ``users`` workload (1,024-token system prompt, 512-token
user contexts, streamed answers of ``--max-tokens``) at ``--rate`` requests a second,
and prints the gateway process's CPU time per request and per second of load.
``--router`` puts a peer there instead (e.g. ``vllm-router:round_robin``), so that
both are measured on the same pods, workload and rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import openai
from rich.console import Console

from bench.fleet import pod_spec
from bench.gateway_proc import run_gateway
from bench.loadgen import ChatRequest
from bench.overhead import process_cpu_s
from bench.peers import PEERS, PodEndpoint, run_peer
from bench.sim.launch import sim_fleet
from bench.tinymodel import MODEL_NAME, ensure_tokenizer
from bench.workloads import user_contexts_workload
from gateway.config import HealthSettings


async def _one(client: openai.AsyncOpenAI, req: ChatRequest, at_s: float, max_tokens: int) -> None:
    await asyncio.sleep(at_s)
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=req.messages,
        max_tokens=max_tokens,
        stream=True,
    )
    async for _ in stream:
        pass


async def _drive(url: str, reqs: list[ChatRequest], rate: float, max_tokens: int) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    await asyncio.gather(*(_one(client, r, i / rate, max_tokens) for i, r in enumerate(reqs)))
    await client.close()


def measure(
    strategy: str, rate: float, max_tokens: int, events: bool, seeds: int, peer: str | None = None
) -> dict[str, float]:
    """``peer`` (``NAME[:POLICY]``): that router instead of a kvgate of ``strategy``."""
    tok = ensure_tokenizer()
    reqs = [r for s in range(seeds) for r in user_contexts_workload(tok, seed=s).requests()]
    with sim_fleet(2, kv_events=True, block_size=32, itl_s=0.005, overhead_s=0.005) as pods:
        env = {
            "KVGATE_MODELS": json.dumps({MODEL_NAME: {"block_size": 32, "tokenizer": str(tok)}}),
            # As deployed: the default probe period, not the test gateways' 0.5 s (each
            # probe reads /health, /v1/models and /metrics from every pod).
            "KVGATE_HEALTH__INTERVAL_S": str(HealthSettings().interval_s),
        }
        endpoints = [
            PodEndpoint(p.url, p.events_endpoint, p.replay_endpoint) if events
            else PodEndpoint(p.url)
            for p in pods
        ]  # fmt: skip
        if peer is not None:
            name, _, policy = peer.partition(":")
            router = run_peer(name, endpoints, MODEL_NAME, 32, policy=policy or None)
        else:
            specs = [(p.name, pod_spec(e)) for p, e in zip(pods, endpoints, strict=True)]
            router = run_gateway(specs, strategy, env=env)
        with router as url:
            time.sleep(1.0)  # start-up work (imports, tokenizer warm-up) is not counted
            before, started = process_cpu_s(url.pid), time.perf_counter()
            asyncio.run(_drive(url, reqs, rate, max_tokens))
            wall = time.perf_counter() - started
            cpu_s = process_cpu_s(url.pid) - before
    return {"requests": len(reqs), "wall_s": wall, "cpu_s": cpu_s,
            "ms_per_request": 1000 * cpu_s / len(reqs), "core_share": cpu_s / wall}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="round-robin")
    p.add_argument("--router", metavar="PEER[:POLICY]",
                   help=f"a peer instead of kvgate ({', '.join(PEERS)}), e.g. "
                        "vllm-router:round_robin")  # fmt: skip
    p.add_argument("--rate", type=float, default=32.0, help="requests per second")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--no-events", action="store_true", help="pods without KV events")
    p.add_argument("--seeds", type=int, default=4, help="96 requests per seed")
    args = p.parse_args(argv)
    console = Console()
    if args.router is not None and args.router.partition(":")[0] not in PEERS:
        p.error(f"--router: one of {', '.join(PEERS)}, optionally with :POLICY")
    label = args.router or args.strategy
    with console.status(f"{label} at {args.rate:g} req/s ..."):
        r = measure(args.strategy, args.rate, args.max_tokens, not args.no_events, args.seeds,
                    peer=args.router)  # fmt: skip
    console.print(
        f"{label}, {args.rate:g} req/s, {args.max_tokens} tokens streamed, KV events "
        f"{'off' if args.no_events else 'on'}: {r['requests']:.0f} requests in "
        f"{r['wall_s']:.1f} s, {'router' if args.router else 'gateway'} CPU "
        f"{r['cpu_s']:.2f} s = {r['ms_per_request']:.2f} ms "
        f"per request, {r['core_share']:.1%} of a core",
        soft_wrap=True,  # one line, however narrow the terminal
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
