"""``kvgate bench shared-load``: what sharing in-flight load costs, and how stale it is.

Three measurements, printed as tables:

1. **Per request**: the routing core's load work for one request (read the load of
   every candidate, count the request, its first token, its end) with this process's
   own ``LoadTracker`` (no sharing), with the other replicas' counts added from the
   last exchange (``CombinedLoad`` over ``RemoteLoad``), and with the host's
   shared-memory table of ``--workers`` workers (``HostLoad``, remote counts included).
   Exchanging with Redis happens off the request path, so this is all a request pays.
2. **Per exchange**: one round trip with Redis (publish this replica's counts, read the
   others') with ``--replicas`` replicas each keeping ``--pods`` pods busy, and Redis's
   own time per call (``INFO commandstats``): what each replica costs Redis every
   ``interval``.
3. **Staleness**: two replicas exchanging every ``--interval-s`` at unrelated phases;
   a request dispatched on one (which pokes its exchange at once, as the gateway's
   does), the time until the other's routing counts it.

A real ``redis-server`` is started on a free loopback port.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from bench.redis_server import running_redis
from bench.stats import percentile
from gateway.fleet_load import FleetLoadExchange, PokingTracker, RemoteLoad
from gateway.host_load import HostLoadTable, pod_key
from kvindex.redis_store import RedisStore
from routing.load import CombinedLoad, LoadTracker, LoadView, PodLoad


@dataclass(frozen=True)
class SharedLoadResult:
    per_request_us: dict[str, float]  # view name -> µs per request
    candidates: int
    exchange_p50_ms: float
    exchange_p99_ms: float
    redis_us_per_exchange: float
    replicas: int
    pods: int
    interval_s: float
    staleness_ms: list[float]


def _per_request_us(view: LoadView, pods: list[str], rounds: int) -> float:
    """µs for one request's load work: read every candidate, count, first token, end."""
    started = time.perf_counter()
    for i in range(rounds):
        for pod in pods:
            view.get(pod)
        r = view.start(pods[i % len(pods)], 100)
        r.first_token()
        r.finish()
    return (time.perf_counter() - started) / rounds * 1e6


def measure_per_request(pods: int, workers: int, rounds: int = 20_000) -> dict[str, float]:
    names = [f"pod-{i}" for i in range(pods)]
    remote = RemoteLoad(max_age_s=60)
    remote.update({pod_key(n): PodLoad(2, 200, 1) for n in names})
    table = HostLoadTable(workers, capacity=1024)
    table.set_remote({pod_key(n): PodLoad(2, 200, 1) for n in names})
    views: dict[str, Callable[[], LoadView]] = {
        "this process only (LoadTracker)": LoadTracker,
        "+ other replicas (Redis exchange)": lambda: CombinedLoad(LoadTracker(), {"fleet": remote}),
        f"host table, {workers} workers (+ replicas)": lambda: table.view(0, 60.0),
    }
    return {name: _per_request_us(make(), names, rounds) for name, make in views.items()}


async def measure_exchange(
    url: str, replicas: int, pods: int, calls: int
) -> tuple[list[float], float]:
    """Exchange latencies (s) of one replica among ``replicas`` with ``pods`` busy pods
    each, and Redis's µs per exchange call."""
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    counts = {pod_key(f"pod-{i}"): PodLoad(3, 1500, 1) for i in range(pods)}
    made = [
        FleetLoadExchange(RedisStore(url, namespace=ns), f"r{i}", lambda: counts, lambda _: None)
        for i in range(replicas)
    ]
    try:
        for ex in made:
            await ex.exchange()
        me = made[0]
        await me.redis.client.config_resetstat()
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            await me.exchange()
            times.append(time.perf_counter() - started)
        stats = await me.redis.client.info("commandstats")
        redis_us = float(stats.get("cmdstat_evalsha", {}).get("usec_per_call", 0.0))
        return times, redis_us
    finally:
        for ex in made:
            await ex.redis.close()


async def measure_staleness(url: str, interval_s: float, samples: int) -> list[float]:
    """ms from a request dispatched on replica A (which pokes its exchange, as the
    gateway's does) to replica B's routing counting it."""
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    seen = asyncio.Event()
    want = {"n": -1}
    remote = RemoteLoad(max_age_s=60)

    def sink_b(loads: dict[int, PodLoad]) -> None:
        remote.update(loads)
        load = remote.others("pod-0")
        if load is not None and load.in_flight == want["n"]:
            seen.set()

    lease = max(1.0, 4 * interval_s)
    a = FleetLoadExchange(RedisStore(url, namespace=ns), "a", dict, lambda _: None,
                          interval_s=interval_s, lease_s=lease)  # fmt: skip
    tracker = PokingTracker(a.poke)
    a._own = lambda: {pod_key(p): v for p, v in tracker.snapshot().items()}
    b = FleetLoadExchange(RedisStore(url, namespace=ns), "b", dict, sink_b,
                          interval_s=interval_s, lease_s=lease)  # fmt: skip
    await a.start()
    await asyncio.sleep(random.random() * interval_s)  # unrelated phases
    await b.start()
    out = []
    try:
        for n in range(1, samples + 1):
            await asyncio.sleep(random.random() * interval_s)
            seen.clear()
            want["n"] = n
            dispatched = time.perf_counter()
            tracker.start("pod-0")  # a request dispatched on A, never finished here
            async with asyncio.timeout(10 * interval_s + 1):
                await seen.wait()
            out.append((time.perf_counter() - dispatched) * 1000)
    finally:
        for ex in (a, b):
            await ex.stop()
            await ex.redis.close()
    return out


def run_shared_load_bench(
    replicas: int = 8,
    pods: int = 16,
    workers: int = 16,
    interval_s: float = 0.02,
    calls: int = 500,
    samples: int = 100,
    console: Console | None = None,
) -> SharedLoadResult:
    console = console or Console(width=140)
    per_request = measure_per_request(pods, workers)
    with running_redis() as redis:
        times, redis_us = asyncio.run(measure_exchange(redis.url, replicas, pods, calls))
        staleness = asyncio.run(measure_staleness(redis.url, interval_s, samples))
    result = SharedLoadResult(
        per_request_us=per_request,
        candidates=pods,
        exchange_p50_ms=percentile([t * 1000 for t in times], 50),
        exchange_p99_ms=percentile([t * 1000 for t in times], 99),
        redis_us_per_exchange=redis_us,
        replicas=replicas,
        pods=pods,
        interval_s=interval_s,
        staleness_ms=staleness,
    )
    print_shared_load(result, console)
    return result


def print_shared_load(r: SharedLoadResult, console: Console) -> None:
    t = Table(title=f"Per request: load read for {r.candidates} candidates, counted, released")
    t.add_column("load view")
    t.add_column("µs per request", justify="right")
    for name, us in r.per_request_us.items():
        t.add_row(name, f"{us:.1f}")
    console.print(t)
    t = Table(title=f"Per exchange: {r.replicas} replicas x {r.pods} busy pods, every "
                    f"{r.interval_s * 1000:.0f} ms per replica")  # fmt: skip
    for col in ("round trip p50 ms", "round trip p99 ms", "Redis µs per call",
                "Redis calls/s (all replicas)"):  # fmt: skip
        t.add_column(col, justify="right")
    t.add_row(f"{r.exchange_p50_ms:.2f}", f"{r.exchange_p99_ms:.2f}",
              f"{r.redis_us_per_exchange:.0f}", f"{r.replicas / r.interval_s:.0f}")  # fmt: skip
    console.print(t)
    s = r.staleness_ms
    t = Table(title=f"Staleness: a request dispatched on one replica until another counts "
                    f"it ({len(s)} samples, interval {r.interval_s * 1000:.0f} ms)")  # fmt: skip
    for col in ("p50 ms", "p90 ms", "p99 ms", "max ms"):
        t.add_column(col, justify="right")
    t.add_row(*(f"{v:.0f}" for v in (percentile(s, 50), percentile(s, 90), percentile(s, 99),
                                       max(s))))  # fmt: skip
    console.print(t)
