"""``kvgate bench soak``: hours of steady load, to see that the gateway's memory stays flat.

A real gateway (kv-aware, local tokenizer, KV events) in front of simulated pods gets
Poisson arrivals at ``rate`` for ``minutes``: chat prompts over a Zipf-popular set of
documents plus a share of one-off prompts, half of them streamed, and a share of
clients that leave early (a streamed one after its first chunk, a non-streamed one
after a random wait). Every minute it reads ``/admin/bounds`` (RSS, open fds, every
bounded structure's size) and the in-flight gauge, and prints a row.

It passes when the RSS at the end is within ``rss_tolerance`` of the RSS at minute
``settle_minute`` (caches fill during the first minutes: the pods' prefix caches,
hence the index, the token cache), every structure stayed at or under its bound, no
request failed other than by its client leaving, and nothing is left in flight.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from bench.polling import metric_value
from bench.prompts import text_of_tokens

MODEL = "kvgate-tiny-llama"
BLOCK = 32
MAX_OPEN_REQUESTS = 2000  # the generator's own bound: beyond it, arrivals are dropped


@dataclass(frozen=True)
class SoakPlan:
    minutes: float = 30.0
    rate: float = 50.0  # requests per second, Poisson
    disconnects: float = 0.3  # share of clients that leave before the answer ends
    strategy: str = "kv-aware"
    pods: int = 3
    documents: int = 300
    document_tokens: int = 600
    unique_share: float = 0.2  # prompts that share nothing with any other
    l0_capacity_blocks: int = 2000  # per pod: the index follows the pods' caches
    settle_minute: int = 5
    rss_tolerance: float = 0.10
    seed: int = 0


@dataclass
class Sample:
    minute: float
    rss_mb: float
    open_fds: int
    in_flight: float
    sent: int
    ok: int
    left: int  # clients that left on purpose
    failed: int
    structures: dict[str, dict[str, int]]


@dataclass
class Counters:
    sent: int = 0
    ok: int = 0
    left: int = 0
    failed: int = 0
    dropped: int = 0  # arrivals skipped because MAX_OPEN_REQUESTS were open
    failures: dict[str, int] = field(default_factory=dict)


class Prompts:
    """Chat bodies: a Zipf-popular document with a fresh question, or a one-off prompt."""

    def __init__(self, plan: SoakPlan, tokenizer_dir: Path) -> None:
        self.plan = plan
        self.rng = random.Random(plan.seed)
        self._dir = tokenizer_dir
        self.docs = [
            text_of_tokens(plan.document_tokens, f"soak-doc-{i}", tokenizer_dir)
            for i in range(plan.documents)
        ]
        weights = [1 / (i + 1) for i in range(plan.documents)]
        total = sum(weights)
        self._weights = [w / total for w in weights]
        self._n = 0

    def body(self) -> dict[str, Any]:
        self._n += 1
        question = text_of_tokens(24, f"soak-q-{self.plan.seed}-{self._n}", self._dir)
        if self.rng.random() < self.plan.unique_share:
            context = text_of_tokens(self.plan.document_tokens, f"soak-u-{self._n}", self._dir)
        else:
            context = self.rng.choices(self.docs, self._weights)[0]
        messages = [
            {"role": "system", "content": "Answer from the document.\n" + context},
            {"role": "user", "content": question},
        ]
        return {"model": MODEL, "messages": messages, "max_tokens": 8}


async def _one(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], leave: bool, c: Counters,
    rng: random.Random,
) -> None:  # fmt: skip
    c.sent += 1
    try:
        if body.get("stream"):
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    _fail(c, f"status {r.status_code}")
                    return
                async for _ in r.aiter_raw():
                    if leave:
                        c.left += 1
                        return  # closing the stream mid-answer
                c.ok += 1
        elif leave:
            try:
                async with asyncio.timeout(rng.uniform(0.005, 0.2)):
                    await client.post(url, json=body)
                c.ok += 1  # answered before the client's patience ran out
            except TimeoutError:
                c.left += 1
        else:
            r = await client.post(url, json=body)
            if r.status_code == 200:
                c.ok += 1
            else:
                _fail(c, f"status {r.status_code}")
    except httpx.HTTPError as exc:
        _fail(c, type(exc).__name__)


def _fail(c: Counters, why: str) -> None:
    c.failed += 1
    c.failures[why] = c.failures.get(why, 0) + 1


async def _sample(admin: httpx.AsyncClient, gateway: str, minute: float, c: Counters) -> Sample:
    bounds = (await admin.get("/admin/bounds")).json()
    metrics = (await admin.get(f"{gateway}/metrics")).text
    return Sample(
        minute=minute,
        rss_mb=(bounds["process"]["rss_bytes"] or 0) / 2**20,
        open_fds=bounds["process"]["open_fds"] or 0,
        in_flight=metric_value(metrics, "kvgate_pod_in_flight_requests"),
        sent=c.sent,
        ok=c.ok,
        left=c.left,
        failed=c.failed,
        structures={
            k: {"size": v["size"], "capacity": v["capacity"]}
            for k, v in bounds["structures"].items()
        },
    )


async def drive(plan: SoakPlan, gateway: str, admin_url: str, tokenizer_dir: Path,
                console: Console) -> tuple[list[Sample], Counters]:  # fmt: skip
    prompts = Prompts(plan, tokenizer_dir)
    rng = random.Random(plan.seed + 1)
    counters = Counters()
    samples: list[Sample] = []
    url = f"{gateway}/v1/chat/completions"
    limits = httpx.Limits(max_connections=MAX_OPEN_REQUESTS, max_keepalive_connections=256)
    open_tasks: set[asyncio.Task[None]] = set()
    duration = plan.minutes * 60
    async with (
        httpx.AsyncClient(limits=limits, timeout=120) as client,
        httpx.AsyncClient(base_url=admin_url, timeout=30) as admin,
    ):
        started = time.monotonic()
        samples.append(await _sample(admin, gateway, 0.0, counters))
        _print_row(console, samples[-1])
        next_sample = 60.0
        next_arrival = 0.0
        progress = Progress(TextColumn("soak"), BarColumn(), TextColumn("{task.fields[status]}"),
                            TimeRemainingColumn(), console=console, transient=True)  # fmt: skip
        with progress:
            task = progress.add_task("soak", total=duration, status="")
            while (now := time.monotonic() - started) < duration:
                if now >= next_sample:
                    samples.append(await _sample(admin, gateway, next_sample / 60, counters))
                    _print_row(console, samples[-1])
                    next_sample += 60
                if now >= next_arrival:
                    next_arrival += rng.expovariate(plan.rate)
                    if len(open_tasks) >= MAX_OPEN_REQUESTS:
                        counters.dropped += 1
                        continue
                    body = prompts.body()
                    body["stream"] = rng.random() < 0.5
                    leave = rng.random() < plan.disconnects
                    t = asyncio.ensure_future(_one(client, url, body, leave, counters, rng))
                    open_tasks.add(t)
                    t.add_done_callback(open_tasks.discard)
                    continue
                progress.update(task, completed=now, status=f"{counters.sent} sent")
                await asyncio.sleep(max(0.0, min(next_arrival, next_sample) - now))
        if open_tasks:
            await asyncio.wait(open_tasks, timeout=120)
        await asyncio.sleep(2)  # the gateway's own clean-up of the last disconnects
        samples.append(await _sample(admin, gateway, duration / 60, counters))
        _print_row(console, samples[-1])
    return samples, counters


def _print_row(console: Console, s: Sample) -> None:
    index = s.structures.get("index", {}).get("size", 0)
    maps = sum(v["size"] for k, v in s.structures.items() if k.startswith("engine_map"))
    tokens = sum(v["size"] for k, v in s.structures.items() if k.startswith("token_cache"))
    console.print(
        f"min {s.minute:5.1f}  rss {s.rss_mb:7.1f} MB  fds {s.open_fds:4d}  "
        f"in-flight {s.in_flight:4.0f}  sent {s.sent:7d}  ok {s.ok:7d}  left {s.left:6d}  "
        f"failed {s.failed:4d}  index {index:7d}  engine maps {maps:7d}  tokens {tokens:8d}"
    )


@dataclass
class Verdict:
    rss_settled_mb: float
    rss_end_mb: float
    rss_change: float
    over_bound: dict[str, tuple[int, int]]
    failed: int
    in_flight_end: float
    passed: bool


def judge(plan: SoakPlan, samples: list[Sample], c: Counters) -> Verdict:
    settled = min(samples[1:] or samples, key=lambda s: abs(s.minute - plan.settle_minute))
    end = samples[-1]
    change = (end.rss_mb - settled.rss_mb) / settled.rss_mb if settled.rss_mb else 0.0
    over = {
        name: (v["size"], v["capacity"])
        for s in samples
        for name, v in s.structures.items()
        if v["size"] > v["capacity"]
    }
    passed = abs(change) <= plan.rss_tolerance and not over and c.failed == 0
    passed = passed and end.in_flight == 0
    return Verdict(settled.rss_mb, end.rss_mb, change, over, c.failed, end.in_flight, passed)


def write_report(plan: SoakPlan, samples: list[Sample], c: Counters, v: Verdict,
                 out: Path) -> Path:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"plan": asdict(plan), "samples": [asdict(s) for s in samples],
         "counters": asdict(c), "verdict": asdict(v)}, indent=1))  # fmt: skip
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    minutes = [s.minute for s in samples]
    ax1.plot(minutes, [s.rss_mb for s in samples], marker="o", label="RSS (MB)")
    ax1.axhspan(v.rss_settled_mb * (1 - plan.rss_tolerance),
                v.rss_settled_mb * (1 + plan.rss_tolerance), alpha=0.15,
                label=f"±{plan.rss_tolerance:.0%} of minute {plan.settle_minute}")  # fmt: skip
    ax1.set_ylabel("MB")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    for name in ("index",):
        ax2.plot(minutes, [s.structures.get(name, {}).get("size", 0) for s in samples],
                 label=name)  # fmt: skip
    ax2.plot(minutes, [sum(x["size"] for k, x in s.structures.items() if k.startswith(
        "engine_map")) for s in samples], label="engine maps (all pods)")  # fmt: skip
    ax2.set_xlabel("minute")
    ax2.set_ylabel("entries")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"soak: {plan.rate:g} req/s, {plan.disconnects:.0%} leave early, "
                 f"{plan.strategy}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)
    plt.close(fig)
    lines = [
        f"# Soak: {plan.minutes:g} min at {plan.rate:g} req/s ({plan.strategy}, "
        f"{plan.pods} simulated pods, {plan.disconnects:.0%} of clients leave early)",
        "",
        f"Command: `kvgate bench soak --minutes {plan.minutes:g} --rate {plan.rate:g} "
        f"--disconnects {plan.disconnects:g} --strategy {plan.strategy}`",
        "",
        f"- RSS minute {plan.settle_minute}: {v.rss_settled_mb:.1f} MB; end: {v.rss_end_mb:.1f} MB "
        f"({v.rss_change:+.1%}; tolerance ±{plan.rss_tolerance:.0%})",
        f"- requests: {c.sent} sent, {c.ok} answered, {c.left} left early on purpose, "
        f"{c.failed} failed {c.failures or ''}, {c.dropped} arrivals dropped by the generator",
        f"- in flight at the end: {v.in_flight_end:g}",
        f"- structures over their bound: {v.over_bound or 'none'}",
        f"- verdict: {'PASS' if v.passed else 'FAIL'}",
        "",
        "![RSS and index size](soak.png)",
        "",
        "| minute | RSS MB | fds | in flight | sent | failed |",
        "|---|---|---|---|---|---|",
        *(
            f"| {s.minute:.0f} | {s.rss_mb:.1f} | {s.open_fds} | {s.in_flight:g} | {s.sent} | "
            f"{s.failed} |"
            for s in samples
        ),  # fmt: skip
        "",
        "Largest size of each bounded structure (capacity):",
        "",
        *(
            f"- `{name}`: {max(s.structures.get(name, {}).get('size', 0) for s in samples)} "
            f"({samples[-1].structures[name]['capacity']})"
            for name in sorted(samples[-1].structures)
        ),  # fmt: skip
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_soak(plan: SoakPlan, out: Path, console: Console | None = None) -> Verdict:
    from bench.gateway_proc import run_gateway
    from bench.sim.launch import sim_fleet
    from bench.tinymodel import ensure_tokenizer

    console = console or Console()
    tokenizer_dir = ensure_tokenizer()
    models = {MODEL: {"block_size": BLOCK, "tokenizer": str(tokenizer_dir)}}
    pod_config = {
        "block_size": BLOCK,
        "itl_s": 0.002,
        "overhead_s": 0.005,
        "prefill_tokens_per_s": 200_000,
        "l0_capacity_blocks": plan.l0_capacity_blocks,
    }
    with (
        sim_fleet(plan.pods, kv_events=True, **pod_config) as pods,
        run_gateway(
            [(p.name, f"{p.url},events={p.events_endpoint}") for p in pods],
            strategy=plan.strategy,
            env={"KVGATE_MODELS": json.dumps(models)},
        ) as gw,
    ):
        samples, counters = asyncio.run(drive(plan, gw, gw.admin, tokenizer_dir, console))
    verdict = judge(plan, samples, counters)
    report = write_report(plan, samples, counters, verdict, out)
    table = Table(title="soak verdict")
    for col in ("RSS min " + str(plan.settle_minute), "RSS end", "change", "failed",
                "over bound", "verdict"):  # fmt: skip
        table.add_column(col)
    table.add_row(f"{verdict.rss_settled_mb:.1f} MB", f"{verdict.rss_end_mb:.1f} MB",
                  f"{verdict.rss_change:+.1%}", str(verdict.failed),
                  str(len(verdict.over_bound)), "PASS" if verdict.passed else "FAIL")  # fmt: skip
    console.print(table)
    console.print(f"report: {report}")
    return verdict
