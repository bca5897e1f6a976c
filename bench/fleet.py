"""``kvgate bench fleet``: every router x tier setup x load over a workload, fresh pods per cell.

A cell is one (workload, tier setup, load, router). For each cell the fleet is
started anew (no router inherits another's cache), the router is started in
front of it (kvgate with one strategy, or a peer router), the workload is sent,
and the pods are asked what they served from which tier. Cells that cannot run
here (a tier the simulator does not have yet, a peer that will not install) are
kept with the reason, so the report says why a row has no numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench.gateway_proc import run_gateway
from bench.loadgen import RequestResult, run_closed_loop, run_open_loop
from bench.peers import PEERS, PeerUnavailable, PodEndpoint, run_peer
from bench.podstats import (
    FleetStats,
    collect,
    gateway_loop_stalls,
    gateway_prediction_error,
    gateway_ttft_ms,
    routing_decision_ms,
)
from bench.profiles import sim_cost_model
from bench.summary import RunSummary, summarize
from bench.variants import split_variant
from bench.workloads import Workload, poisson_arrivals

STRATEGIES = ["round-robin", "least-loaded", "prefix-aware", "kv-aware"]
TIER_NAMES = ["L0", "L0+L1", "L0+L1+L2"]


@dataclass(frozen=True)
class Load:
    """Arrival process: ``closed`` (N users) or ``poisson`` (QPS) or ``trace`` (timestamps)."""

    kind: str
    value: float = 0.0

    @property
    def label(self) -> str:
        if self.kind == "closed":
            return f"{int(self.value)} users"
        return f"{self.value:g} qps" if self.kind == "poisson" else "trace"

    @staticmethod
    def parse(text: str) -> Load:
        """``closed:8``, ``poisson:4``, ``trace``."""
        kind, _, value = text.partition(":")
        if kind not in ("closed", "poisson", "trace"):
            raise ValueError(f"unknown load {text!r}: closed:N, poisson:QPS or trace")
        return Load(kind, float(value or 0))


@dataclass
class FleetPlan:
    workloads: list[Workload]
    routers: list[str] = field(default_factory=lambda: list(STRATEGIES))
    tiers: list[str] = field(default_factory=lambda: ["L0"])
    loads: list[Load] = field(default_factory=lambda: [Load("closed", 8)])
    pods: int = 4
    pod_config: dict[str, Any] = field(default_factory=dict)  # SimConfig overrides
    l1_capacity_blocks: int = 4096
    profile: str | None = None
    redis: bool = False
    pods_url: list[str] = field(default_factory=list)  # real pods: "URL[,events=..,replay=..]"
    model: str = "kvgate-tiny-llama"
    block_size: int = 32
    seed: int = 0
    peer_tiers: list[str] | None = None  # peer routers run on these tier setups only (None: all)
    # kvgate scaled out: replicas behind one Service (the load generator spreads requests
    # over them at random), each with ``workers`` processes; with ``redis`` they share
    # the index and (``share_load``) their in-flight counts.
    gateways: int = 1
    workers: int = 1
    share_load: bool = True
    # kvgate's health-probe period (each probe reads the pod's /health, /v1/models and
    # /metrics); None: the benchmark gateways' 0.5 s (bench.gateway_proc).
    health_interval_s: float | None = None


@dataclass
class Cell:
    workload: str
    tiers: str
    load: str
    router: str
    summary: RunSummary | None = None
    stats: FleetStats | None = None
    decision_ms: float | None = None  # kvgate only: tokenize + lookup + choose
    gateway_ttft_ms: float | None = None  # kvgate only: its arrival to the pod's first byte
    gateway_prediction_error: float | None = None  # kvgate only: on its own clock
    loop_stalls: int | None = None  # kvgate only: 100 ms loop samples woken > 20 ms late
    # Every request's result (``kvgate bench real`` writes them out, one row each).
    results: list[RequestResult] = field(default_factory=list, repr=False)
    skipped: str = ""
    gateways: int = 1  # kvgate replicas the requests were spread over
    per_gateway: list[int] = field(default_factory=list)  # requests each replica served
    gateway_rss_mib: list[float] = field(default_factory=list)  # each replica's RSS at the end
    redis_mib: float | None = None  # the shared Redis's used_memory at the end

    def as_json(self) -> dict[str, Any]:
        """The cell as results.json keeps it: without its per-request results."""
        row = asdict(replace(self, results=[]))
        del row["results"]
        return row

    @property
    def ttfts_ms(self) -> list[float]:
        """TTFT of each request that succeeded, in ms (the plots' distributions)."""
        return [r.ttft_s * 1000 for r in self.results if r.ok]

    @property
    def overhead_ms(self) -> float | None:
        """Mean client TTFT minus mean pod-measured TTFT: what the router (and HTTP) add."""
        if self.summary is None or self.stats is None or self.stats.pod_ttft_mean_s is None:
            return None
        return self.summary.ttft_mean_ms - self.stats.pod_ttft_mean_s * 1000


@functools.lru_cache(maxsize=1)
def sim_flags() -> frozenset[str]:
    """Flags the simulated pod accepts (tier options arrive over time)."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.sim", "--help"], capture_output=True, text=True, timeout=60
    )
    return frozenset(w.strip(",[]") for w in out.stdout.split() if w.startswith("--"))


def tier_overrides(tier: str, plan: FleetPlan, l2_dir: Path) -> dict[str, Any] | str:
    """SimConfig overrides for a tier setup, or the reason it cannot run here."""
    need: dict[str, Any] = {}
    if tier in ("L0+L1", "L0+L1+L2"):
        need["l1_capacity_blocks"] = plan.l1_capacity_blocks
    if tier == "L0+L1+L2":
        need["l2_dir"] = str(l2_dir)
    if tier not in TIER_NAMES:
        return f"unknown tier setup {tier!r}"
    missing = [
        "--" + k.replace("_", "-") for k in need if "--" + k.replace("_", "-") not in sim_flags()
    ]
    if missing:
        return f"simulated pod has no {', '.join(missing)} yet"
    return need


def _endpoint(spec: str) -> PodEndpoint:
    url, *opts = spec.split(",")
    kv = dict(o.split("=", 1) for o in opts if "=" in o)
    return PodEndpoint(url.rstrip("/"), kv.get("events"), kv.get("replay"))


def pod_spec(p: PodEndpoint) -> str:
    """``p`` as a `kvgate serve --pod NAME=...` value: its URL, then its event sources."""
    extra = (f",events={p.events}" if p.events else "") + (
        f",replay={p.replay}" if p.replay else ""
    )
    return p.url + extra


@contextlib.contextmanager
def _pods(plan: FleetPlan, overrides: dict[str, Any]) -> Iterator[list[PodEndpoint]]:
    if plan.pods_url:
        endpoints = [_endpoint(s) for s in plan.pods_url]
        for p in endpoints:  # best effort: real vLLM needs --enable-dev-mode... for this
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{p.url}/reset_prefix_cache", timeout=10.0)
        yield endpoints
        return
    from bench.sim.launch import sim_fleet

    config = {"hash_seed": "vllm-none-hash", "block_size": plan.block_size, **plan.pod_config}
    if plan.profile:
        config["profile"] = plan.profile
    with sim_fleet(plan.pods, kv_events=True, **config, **overrides) as fleet:
        yield [PodEndpoint(p.url, p.events_endpoint, p.replay_endpoint) for p in fleet]


def _gateway_env(plan: FleetPlan, redis_url: str | None) -> dict[str, str]:
    from bench.tinymodel import ensure_tokenizer

    model: dict[str, Any] = {"block_size": plan.block_size}
    if plan.model == "kvgate-tiny-llama":
        model["tokenizer"] = str(ensure_tokenizer())
    # The load generator compares predicted with served cached tokens.
    env = {"KVGATE_MODELS": json.dumps({plan.model: model}), "KVGATE_EXPOSE_PREDICTIONS": "true"}
    if not plan.pods_url:
        # Configure kv-aware with the simulated hardware's numbers, as a user would
        # configure it for theirs (calibration then only has to fine-tune).
        overrides = {**plan.pod_config, **({"profile": plan.profile} if plan.profile else {})}
        cost = sim_cost_model(overrides, plan.block_size).to_dict()
        env["KVGATE_STRATEGY_OPTIONS"] = json.dumps({"kv-aware": {"cost_model": cost}})
    if redis_url:
        env |= {"KVGATE_INDEX__BACKEND": "redis", "KVGATE_INDEX__REDIS_URL": redis_url}
    if plan.health_interval_s is not None:
        env["KVGATE_HEALTH__INTERVAL_S"] = str(plan.health_interval_s)
    return env


def _kv_aware_options(env: dict[str, str]) -> dict[str, Any] | None:
    """The kv-aware options a gateway started with ``env`` gets (``env`` first, then
    this process's environment, as ``run_gateway`` merges them)."""
    raw = env.get("KVGATE_STRATEGY_OPTIONS") or os.environ.get("KVGATE_STRATEGY_OPTIONS")
    return json.loads(raw).get("kv-aware") if raw else None


@dataclass
class Routers:
    """The URLs requests are spread over (one unless kvgate is scaled out), their
    processes, and the shared Redis if any (for the memory columns)."""

    urls: list[str]
    pids: list[int] = field(default_factory=list)
    redis_url: str | None = None


def is_peer(router: str) -> bool:
    """``router`` names a peer (``sglang-router``, ``vllm-router:cache_aware``), not a
    kvgate strategy."""
    return router.partition(":")[0] in PEERS


@contextlib.contextmanager
def _router(plan: FleetPlan, router: str, pods: list[PodEndpoint]) -> Iterator[Routers]:
    if is_peer(router):
        name, _, policy = router.partition(":")
        with run_peer(name, pods, plan.model, plan.block_size, policy=policy or None) as url:
            yield Routers([url])
        return
    with contextlib.ExitStack() as stack:
        redis_url = None
        if plan.redis:
            from bench.redis_server import running_redis

            redis_url = stack.enter_context(running_redis()).url
        named = [(f"pod-{i}", pod_spec(p)) for i, p in enumerate(pods)]
        strategy, variant = split_variant(router)
        env = _gateway_env(plan, redis_url)
        if variant.name:
            env |= variant.gateway_env(_kv_aware_options(env))
        gateways = [
            stack.enter_context(
                run_gateway(named, strategy=strategy, env=env, workers=plan.workers)
            )
            for _ in range(plan.gateways)
        ]
        yield Routers(list(gateways), [g.pid for g in gateways], redis_url)


def _drive(
    url: str | list[str], plan: FleetPlan, workload: Workload, load: Load, label: str
) -> list[RequestResult]:
    seed = plan.seed
    if workload.timed or load.kind == "trace":
        coro = run_open_loop(url, plan.model, workload.requests(), label, seed)
    elif load.kind == "poisson":
        reqs = poisson_arrivals(workload.requests(), load.value, plan.seed)
        coro = run_open_loop(url, plan.model, reqs, label, seed)
    else:
        sessions = workload.sessions
        coro = run_closed_loop(url, plan.model, sessions, int(load.value), label, seed)
    return asyncio.run(coro)


def run_cell(plan: FleetPlan, workload: Workload, tier: str, load: Load, router: str) -> Cell:
    """One cell on a fresh fleet; a cell that cannot run comes back with ``skipped`` set."""
    scaled = not is_peer(router)
    cell = Cell(workload.name, tier, load.label, router, gateways=plan.gateways if scaled else 1)
    with tempfile.TemporaryDirectory(prefix="kvgate-l2-") as l2_dir:
        overrides = {} if plan.pods_url else tier_overrides(tier, plan, Path(l2_dir))
        if isinstance(overrides, str):
            cell.skipped = overrides
            return cell
        try:
            with _pods(plan, overrides) as pods, _router(plan, router, pods) as routers:
                label = f"{workload.name} {tier} {load.label} {router}"
                if cell.gateways > 1:
                    label += f" x{cell.gateways}"
                started = time.perf_counter()
                results = _drive(routers.urls, plan, workload, load, label)
                cell.summary = summarize(router, results, time.perf_counter() - started)
                cell.results = results
                cell.stats = collect([p.url for p in pods], simulated=not plan.pods_url)
                cell.per_gateway = [
                    sum(1 for r in results if r.gateway == i) for i in range(len(routers.urls))
                ]
                if scaled:
                    cell.decision_ms = routing_decision_ms(routers.urls[0])
                    cell.gateway_ttft_ms = gateway_ttft_ms(routers.urls[0])
                    cell.gateway_prediction_error = gateway_prediction_error(routers.urls[0])
                    cell.loop_stalls = gateway_loop_stalls(routers.urls[0])
                    cell.gateway_rss_mib = [rss_mib(pid) for pid in routers.pids]
                    if routers.redis_url:
                        cell.redis_mib = redis_used_mib(routers.redis_url)
        except PeerUnavailable as exc:
            cell.skipped = f"{router} unavailable: {exc}"
        except (TimeoutError, RuntimeError) as exc:  # a pod or gateway did not come up
            cell.skipped = f"did not start: {str(exc).splitlines()[0][:160]}"
    return cell


def rss_mib(pid: int) -> float:
    """A process's resident memory (MiB) with its children's (``--workers``)."""
    total_kib = 0
    pids = [pid]
    with contextlib.suppress(OSError):
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
    return total_kib / 1024


def redis_used_mib(url: str) -> float | None:
    import redis

    try:
        with redis.Redis.from_url(url, socket_timeout=2) as client:
            return int(client.info("memory")["used_memory"]) / 2**20
    except (redis.RedisError, OSError):
        return None


def run_cell_retrying(
    plan: FleetPlan, workload: Workload, tier: str, load: Load, router: str
) -> Cell:
    """``run_cell``, tried once more when the fleet did not start (a port taken meanwhile)."""
    cell = run_cell(plan, workload, tier, load, router)
    if cell.skipped.startswith("did not start"):
        cell = run_cell(plan, workload, tier, load, router)
    return cell


def _peer_not_run(plan: FleetPlan, router: str, tier: str) -> str:
    """Why a peer's cell is left out by the plan (``peer_tiers``), or "" if it runs."""
    if not is_peer(router) or plan.peer_tiers is None or plan.pods_url:
        return ""  # real pods have one tier setup, "as deployed": everyone runs on it
    if tier in plan.peer_tiers:
        return ""
    return f"not run: this plan runs peers on {', '.join(plan.peer_tiers) or 'no tier'} only"


def run_fleet(plan: FleetPlan, on_cell: Any = None) -> list[Cell]:
    """Every workload x tier setup x load x router, in that nesting order."""
    cells: list[Cell] = []
    tiers = plan.tiers if not plan.pods_url else ["as deployed"]
    for workload in plan.workloads:
        loads = [Load("trace")] if workload.timed else plan.loads
        for tier in tiers:
            for load in loads:
                for router in plan.routers:
                    if not_here := _peer_not_run(plan, router, tier):
                        cell = Cell(workload.name, tier, load.label, router, skipped=not_here)
                    else:
                        cell = run_cell_retrying(plan, workload, tier, load, router)
                    cells.append(cell)
                    if on_cell is not None:
                        on_cell(cell)
    return cells
