"""``kvgate bench admission``: admission control on a simulated fleet under overload.

Two experiments in the discrete-event simulator (``bench.des``), whose routing and
admission decisions are the gateway's own code (``routing.core``,
``routing.admission``):

1. **Goodput under overload.** Poisson arrivals at multiples of the fleet's capacity,
   one TTFT SLO for all. Goodput is the requests whose TTFT met the SLO per second of
   arrivals; without admission control every request joins a pod's queue, the queues
   grow without bound and hardly any request meets the SLO; with it, requests the
   cost model predicts late are shed (429) and the rest keep their SLO.
2. **Priorities under a flood.** A steady high-priority tenant, a low-priority tenant
   flooding at 1.5x capacity and a modest low-priority tenant: the high-priority
   TTFT p90, and whether the modest tenant is starved by the flooding one.

Prompts: one of eight shared 1,024-token prefixes plus a unique part; pods: the
``original`` profile (Qwen2-7B on A10G), GPU cache only. The capacity the loads are
multiples of is the prefill lane's: pods / mean prefill time with the prefix cached.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.des.sim import FleetSim
from bench.des.types import DesPodSpec, DesRequest, DesResult
from bench.des.workload import mooncake_keys
from bench.profiles import get_profile
from bench.stats import percentile
from routing.admission import AdmissionPolicy

PROFILE = "original"
BLOCK_SIZE = 16
PREFIXES = 8
PREFIX_TOKENS = 1024
UNIQUE_TOKENS = (256, 1024)  # uniform
OUTPUT_TOKENS = (32, 128)
HIGH, LOW = 0, 1


@dataclass(frozen=True)
class Stream:
    """One tenant's Poisson arrivals, at ``share`` of the fleet's capacity."""

    tenant: str
    priority: int
    share: float


@dataclass(frozen=True)
class Setup:
    """A router configuration: strategy, and admission control or none."""

    label: str
    strategy: str
    admission: AdmissionPolicy | None = None


@dataclass
class Row:
    """One setup at one load (or one stream of the flood), as the tables print it."""

    setup: str
    load: str
    offered_rps: float
    goodput_rps: float
    served_in_slo: float  # share of all requests served within the SLO
    shed: float  # share answered 429
    ttft_p50_ms: float  # of the served
    ttft_p90_ms: float
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    pods: int = 4
    seconds: float = 60.0
    slo_s: float = 1.0
    loads: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0)
    seed: int = 0
    max_prefilling_per_pod: int = 2  # the limit of the setups that have one

    def spec(self) -> DesPodSpec:
        return DesPodSpec.from_profile(get_profile(PROFILE), BLOCK_SIZE, "L0")

    def capacity_rps(self) -> float:
        """Requests per second the fleet's prefill lanes finish with the prefix cached."""
        mean_unique = sum(UNIQUE_TOKENS) / 2
        return self.pods / self.spec().timing.compute_s(int(mean_unique))

    def setups(self) -> list[Setup]:
        slo, queue = self.slo_s, self.max_prefilling_per_pod
        return [
            Setup("kv-aware, no admission", "kv-aware"),
            Setup("kv-aware + admission: shed on predicted TTFT", "kv-aware",
                  AdmissionPolicy(ttft_slo_s=slo, priorities=2)),
            Setup(f"kv-aware + admission: shed on predicted TTFT, {queue} prefilling per pod",
                  "kv-aware", AdmissionPolicy(ttft_slo_s=slo, priorities=2,
                                              max_prefilling_per_pod=queue)),
            Setup("round-robin, no admission", "round-robin"),
            Setup(f"round-robin + admission: {queue} prefilling per pod, shed by queue position",
                  "round-robin", AdmissionPolicy(ttft_slo_s=slo, priorities=2,
                                                 max_prefilling_per_pod=queue)),
        ]  # fmt: skip


FLOOD = (Stream("search", HIGH, 0.3), Stream("batch", LOW, 1.5), Stream("etl", LOW, 0.15))


def requests(plan: Plan, streams: Sequence[Stream], load: float = 1.0) -> list[DesRequest]:
    """Poisson arrivals of every stream over ``plan.seconds``, merged in time order."""
    rng = random.Random(plan.seed)
    capacity = plan.capacity_rps()
    prefix_blocks = PREFIX_TOKENS // BLOCK_SIZE
    out: list[DesRequest] = []
    serial = 0
    for stream in streams:
        rate = stream.share * load * capacity
        t = rng.expovariate(rate)
        while t < plan.seconds:
            unique = rng.randint(*UNIQUE_TOKENS)
            prompt = PREFIX_TOKENS + unique
            p = rng.randrange(PREFIXES)
            serial += 1
            ids = [p * 1000 + j for j in range(prefix_blocks)]
            ids += [10**9 + serial * 1000 + j for j in range(unique // BLOCK_SIZE)]
            keys = mooncake_keys(ids, prompt // BLOCK_SIZE, "admission-bench")
            out.append(DesRequest(t, prompt, rng.randint(*OUTPUT_TOKENS), keys,
                                  priority=stream.priority, tenant=stream.tenant,
                                  slo_s=plan.slo_s))  # fmt: skip
            t += rng.expovariate(rate)
    out.sort(key=lambda r: r.arrival_s)
    return out


def simulate(plan: Plan, setup: Setup, reqs: list[DesRequest]) -> list[DesResult]:
    spec = plan.spec()
    options = None
    if setup.strategy == "kv-aware":
        options = {"cost_model": get_profile(PROFILE).cost_model(BLOCK_SIZE)}
    sim = FleetSim(plan.pods, setup.strategy, spec, strategy_options=options,
                   admission=setup.admission)  # fmt: skip
    sim.run_open(reqs)
    return sorted(sim.results, key=lambda r: r.index)


def row(plan: Plan, setup: str, load: str, results: Sequence[DesResult]) -> Row:
    served = [r for r in results if not r.shed]
    good = sum(1 for r in served if r.ttft_s <= plan.slo_s)
    ttft = [r.ttft_s * 1000 for r in served]
    n = max(1, len(results))
    shed = (len(results) - len(served)) / n
    return Row(setup, load, len(results) / plan.seconds, good / plan.seconds, good / n, shed,
               percentile(ttft, 50), percentile(ttft, 90))  # fmt: skip


def goodput_rows(plan: Plan) -> list[Row]:
    rows = []
    everyone = (Stream("all", HIGH, 1.0),)
    for load in plan.loads:
        reqs = requests(plan, everyone, load)
        for setup in plan.setups():
            rows.append(row(plan, setup.label, f"{load:g}x", simulate(plan, setup, reqs)))
    return rows


def flood_rows(plan: Plan) -> list[Row]:
    rows = []
    reqs = requests(plan, FLOOD)
    for setup in plan.setups():
        results = simulate(plan, setup, reqs)
        for stream in FLOOD:
            mine = [r for r in results if r.tenant == stream.tenant]
            name = f"{stream.tenant} ({'high' if stream.priority == HIGH else 'low'}, " \
                   f"{stream.share:g}x)"  # fmt: skip
            rows.append(row(plan, setup.label, name, mine))
    return rows


def run_admission_bench(plan: Plan, out: Path, doc: Path | None = None) -> tuple[list[Row], ...]:
    from bench.admission_report import print_tables, write_report

    started = time.perf_counter()
    goodput, flood = goodput_rows(plan), flood_rows(plan)
    wall = time.perf_counter() - started
    print_tables(plan, goodput, flood)
    report = write_report(plan, goodput, flood, out, wall, doc)
    print(f"report: {report}" + (f"\ndoc: {doc}" if doc is not None else ""))
    return goodput, flood
