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
3. **Staleness on the clock** (a ``--workers`` host's worker 0, which exchanges every
   ``--interval-s``): two replicas at unrelated phases; a request dispatched on one
   (which pokes its exchange at once, as the gateway's does), the time until the
   other's copy counts it.
4. **Staleness at routing decisions** (a single-process replica, which exchanges
   between requests only every lease / 4 and has a request read the others' counts
   when its copy is older than ``--interval-s``): replica A dispatches at random
   (Poisson, a request every 10 ms); replica B routes at random, busy (a request
   every 5 ms) or quiet (every 100 ms), each request awaiting ``fresh`` as the
   gateway's do and poking B's exchange once counted. Per decision: how long before
   it the oldest of A's dispatches it does not count was made (0 if it counts them
   all), and what share of decisions miss one.

A real ``redis-server`` is started on a free loopback port.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    # (B reads when stale, B's mean gap between requests in ms) -> per decision, ms
    # since the oldest of A's dispatches it missed (0: none)
    decision_lag_ms: dict[tuple[bool, float], list[float]]


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
    a._own = tracker.keyed_counts
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


async def measure_decision_lag(
    url: str,
    interval_s: float,
    gap_s: float,
    samples: int,
    on_demand: bool = True,
    a_gap_s: float = 0.01,
) -> list[float]:
    """Per routing decision of replica B (a request every ``gap_s`` on average, reading
    the others' counts when its copy is older than ``interval_s``, as one gateway
    process does; ``on_demand=False``: exchanging every ``interval_s`` instead, as a
    ``--workers`` host does): ms since the oldest of replica A's dispatches (a request
    every ``a_gap_s``) that the decision did not count; 0 when it counted them all."""
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    lease = max(1.0, 4 * interval_s)
    remote = RemoteLoad(max_age_s=60)
    idle_s = lease / 4 if on_demand else interval_s
    clocks = {"interval_s": interval_s, "idle_interval_s": idle_s, "lease_s": lease}
    a = FleetLoadExchange(RedisStore(url, namespace=ns), "a", dict, lambda _: None, **clocks)
    a_tracker = PokingTracker(a.poke)
    a._own = a_tracker.keyed_counts
    b = FleetLoadExchange(RedisStore(url, namespace=ns), "b", dict, remote.update, **clocks)
    b_tracker = PokingTracker(b.poke)
    b._own = b_tracker.keyed_counts
    dispatched: list[float] = []  # when A dispatched its n-th request (never finished)

    async def replica_a() -> None:
        while True:
            await asyncio.sleep(random.expovariate(1 / a_gap_s))
            dispatched.append(time.perf_counter())
            a_tracker.start("pod-0")

    await a.start()
    await b.start()
    lags = []
    writer = asyncio.create_task(replica_a())
    try:
        await asyncio.sleep(0.2)
        for _ in range(samples):
            await asyncio.sleep(random.expovariate(1 / gap_s))
            waiter = b.fresh() if on_demand else None
            if waiter is not None:
                await waiter
            now = time.perf_counter()
            seen = remote.others("pod-0")
            counted = seen.in_flight if seen is not None else 0
            missed = [t for t in dispatched[counted:] if t < now]
            lags.append((now - missed[0]) * 1000 if missed else 0.0)
            b_tracker.start("pod-1")  # B's own dispatch pokes its exchange
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
        for ex in (a, b):
            await ex.stop()
            await ex.redis.close()
    return lags


# B's mean gap between requests: busy and quiet
DECISION_GAPS_S = (0.005, 0.1)


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
        lags = {
            (on_demand, gap * 1000): asyncio.run(
                measure_decision_lag(redis.url, interval_s, gap, 4 * samples, on_demand)
            )
            for on_demand in (True, False)
            for gap in DECISION_GAPS_S
        }
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
        decision_lag_ms=lags,
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
    t = Table(title=f"Staleness on the clock (a --workers host): a request dispatched on one "
                    f"replica until another counts it ({len(s)} samples, interval "
                    f"{r.interval_s * 1000:.0f} ms)")  # fmt: skip
    for col in ("p50 ms", "p90 ms", "p99 ms", "max ms"):
        t.add_column(col, justify="right")
    t.add_row(*(f"{v:.0f}" for v in (percentile(s, 50), percentile(s, 90), percentile(s, 99),
                                       max(s))))  # fmt: skip
    console.print(t)
    t = Table(title="Staleness at routing decisions (one process per replica): the oldest of "
                    "another replica's dispatches (one every 10 ms) a decision does not "
                    f"count, ms before it (interval {r.interval_s * 1000:.0f} ms)")  # fmt: skip
    for col in ("this replica", "reads others' counts", "decisions", "missing one", "p50 ms",
                "p90 ms", "p99 ms", "max ms"):  # fmt: skip
        t.add_column(col, justify="right")
    for (on_demand, gap_ms), lags in r.decision_lag_ms.items():
        missing = sum(1 for v in lags if v > 0) / len(lags)
        spread = [f"{percentile(lags, q):.1f}" for q in (50, 90, 99)] + [f"{max(lags):.1f}"]
        how = "when stale (one process)" if on_demand else "on the clock (--workers)"
        t.add_row(f"a request every {gap_ms:.0f} ms", how, str(len(lags)), f"{missing:.0%}",
                  *spread)  # fmt: skip
    console.print(t)
