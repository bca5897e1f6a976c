"""``kvgate bench overhead``: what a router adds to each request, and how many it passes.

Every router (kvgate per strategy, and the peers when installed) is put in front of the
same zero-latency backend (``bench.zero_pod``: canned answers, no engine work), so
what a request through it costs beyond a direct request is the router's own cost.

Per router:

- **added latency**: sequential pairs, one request direct and one through the router
  (alternating which goes first), on varied ~8 KB two-message chat bodies (a new
  system prompt each time: no cache helps); the per-pair difference is the added
  latency, which cancels drift in the machine's speed. p50 and p99.
- **streaming TTFT added**: the same with ``"stream": true``, to the first body byte.
- **throughput**: ``wrk`` (C, from Debian's package) with 32 connections for a few
  seconds, every request a new conversation (a Lua script makes the bodies); the
  direct rate is measured the same way.
- for kvgate also its **CPU per request** (all its processes, during the throughput
  run): with ``--workers 1,2`` (routers ``kvgate:STRATEGY@N``) it says how far req/s
  scales on free cores even where the machine's cores are shared.
- for index strategies also a **multi-turn** workload: each request extends a
  conversation that an earlier request sent, so earlier turns are already tokenized.

The report prints a table like the one that asks for these numbers, and writes
``report.md``, ``results.json`` and a PNG under ``--out``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.machine_speed import SpeedSampler
from bench.overhead_summary import column_stats, markdown
from bench.polling import http_status, wait_for
from bench.ports import free_port
from bench.processes import stop
from bench.stats import percentile

MODEL = "kvgate-tiny-llama"
_WORDS = (
    "cache prefix block token router gateway replica request latency prefill decode memory "
    "tier shared storage model system prompt document question answer user session history "
    "fleet pod queue load balance event index hash key value the a of to and in is for on"
).split()


@dataclass
class RouterResult:
    router: str
    workload: str  # "varied" or "multi-turn"
    added_p50_ms: float = float("nan")
    added_p99_ms: float = float("nan")
    stream_ttft_added_ms: float = float("nan")
    rps: float = float("nan")
    errors: int = 0
    note: str = ""
    # CPU seconds the router's process (kvgate: all its workers) spent per request under
    # wrk, in ms; what bounds req/s when cores are free (N workers: N cores / this).
    cpu_ms: float = float("nan")
    run: int = 0  # which of ``--runs`` rounds measured it
    # The machine's speed while it was measured: median CPU ms of bench.machine_speed's
    # loop (~0.85 at this VM's fast speed, ~1.4 at its slow one; CPU costs follow it).
    machine_ms: float = float("nan")


@dataclass
class OverheadReport:
    direct_rps: float
    connections: int
    seconds: float
    prompt_bytes: int
    results: list[RouterResult] = field(default_factory=list)
    wrk: bool = True
    runs: int = 1


def _text(rng: random.Random, n_bytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


class Bodies:
    """Chat bodies: ``varied`` (a new ~8 KB conversation each) or ``multi-turn`` (each
    extends a conversation sent before)."""

    def __init__(self, prompt_bytes: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.prompt_bytes = prompt_bytes
        self.base = _text(self.rng, prompt_bytes)
        self._n = 0
        self._conversations: list[list[dict[str, str]]] = []

    def varied(self, stream: bool = False) -> bytes:
        self._n += 1
        system = f"{self._n}-{self.rng.random()} {self.base}"
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"question {self._n}?"}]  # fmt: skip
        return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 1,
                           "stream": stream}).encode()  # fmt: skip

    def multi_turn(self, stream: bool = False, live: int = 16, turns: int = 8) -> bytes:
        """Round-robin over ``live`` conversations; one of ``turns`` turns is new."""
        self._n += 1
        slot = self._n % live
        while len(self._conversations) <= slot:
            self._conversations.append([])
        conv = self._conversations[slot]
        if len(conv) >= 2 * turns or not conv:
            conv.clear()
            half = self.prompt_bytes // 2
            conv.append({"role": "system", "content": f"{self._n} {self.base[:half]}"})
        conv.append({"role": "user", "content": _text(self.rng, self.prompt_bytes // 16)})
        body = json.dumps({"model": MODEL, "messages": conv, "max_tokens": 1, "stream": stream})
        conv.append({"role": "assistant", "content": _text(self.rng, self.prompt_bytes // 16)})
        return body.encode()


# -- processes ----------------------------------------------------------------------------


@contextlib.contextmanager
def zero_pod() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.zero_pod", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_status(f"{url}/health") == 200, 10, what="the zero pod")
        yield url
    finally:
        stop(proc)


@contextlib.contextmanager
def router(name: str, pod_url: str) -> Iterator[str]:
    """A kvgate strategy (``kvgate:<strategy>``, ``kvgate:<strategy>@<N>`` with N worker
    processes) or a peer (``<peer>:<policy>``)."""
    kind, _, policy = name.partition(":")
    if kind == "kvgate":
        from bench.gateway_proc import run_gateway
        from bench.tinymodel import ensure_tokenizer

        strategy, _, workers = policy.partition("@")
        models = {MODEL: {"block_size": 32, "tokenizer": str(ensure_tokenizer())}}
        with run_gateway([("zero", pod_url)], strategy=strategy, workers=int(workers or 1),
                         env={"KVGATE_MODELS": json.dumps(models)}) as url:  # fmt: skip
            yield url
        return
    from bench.peers import PodEndpoint, run_peer

    with run_peer(kind, [PodEndpoint(pod_url)], MODEL, 32, policy=policy) as url:
        yield url


# -- measurements -------------------------------------------------------------------------


async def _timed(client: httpx.AsyncClient, url: str, body: bytes, stream: bool) -> float:
    started = time.perf_counter()
    if stream:
        async with client.stream("POST", url, content=body,
                                 headers={"content-type": "application/json"}) as r:  # fmt: skip
            r.raise_for_status()
            async for _ in r.aiter_raw():
                return time.perf_counter() - started
        return time.perf_counter() - started
    r = await client.post(url, content=body, headers={"content-type": "application/json"})
    r.raise_for_status()
    return time.perf_counter() - started


async def paired(
    direct: str, via: str, bodies: Bodies, workload: str, pairs: int, stream: bool
) -> list[float]:
    """Per-pair (router - direct) latency in ms, pairs alternating which goes first."""
    make = bodies.varied if workload == "varied" else bodies.multi_turn
    diffs: list[float] = []
    path = "/v1/chat/completions"
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(20):  # warm connections, caches and code paths
            await _timed(client, direct + path, make(stream), stream)
            await _timed(client, via + path, make(stream), stream)
        for i in range(pairs):
            body_direct, body_via = make(stream), make(stream)
            if i % 2:
                v = await _timed(client, via + path, body_via, stream)
                d = await _timed(client, direct + path, body_direct, stream)
            else:
                d = await _timed(client, direct + path, body_direct, stream)
                v = await _timed(client, via + path, body_via, stream)
            diffs.append((v - d) * 1000)
    return diffs


_WRK_SCRIPT = r"""
local counter = 0
local words = {%(words)s}
local base = "%(base)s"
local turns, live = 8, 16
local convs = {}
function setup(thread) thread:set("tid", math.random(1, 1e9)) end
local function text(n)
  local out = {}
  for i = 1, n do out[i] = words[math.random(#words)] end
  return table.concat(out, " ")
end
local function msg(role, content)
  return '{"role":"' .. role .. '","content":"' .. content .. '"}'
end
request = function()
  counter = counter + 1
  local messages
  if "%(workload)s" == "varied" then
    messages = msg("system", tostring(tid) .. "-" .. counter .. " " .. base)
      .. "," .. msg("user", "question " .. counter .. "?")
  else
    local slot = counter %% live
    local conv = convs[slot]
    if conv == nil or conv.n >= 2 * turns then
      conv = {n = 1, parts = {msg("system", tostring(tid) .. "-" .. counter .. " "
        .. string.sub(base, 1, math.floor(#base / 2)))}}
      convs[slot] = conv
    end
    conv.n = conv.n + 1
    conv.parts[conv.n] = msg("user", text(%(turn_words)d))
    messages = table.concat(conv.parts, ",")
    conv.n = conv.n + 1
    conv.parts[conv.n] = msg("assistant", text(%(turn_words)d))
  end
  local body = '{"model":"%(model)s","max_tokens":1,"messages":[' .. messages .. ']}'
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"]="application/json"}, body)
end
"""


def wrk_script(workload: str, base: str) -> str:
    """wrk's Lua script sending ``workload`` bodies built around ``base`` (a prompt)."""
    return _WRK_SCRIPT % {
        "words": ",".join(f'"{w}"' for w in _WORDS), "base": base, "workload": workload,
        "turn_words": max(4, len(base) // 16 // 6), "model": MODEL,
    }  # fmt: skip


def wrk_rps(
    url: str, workload: str, seconds: float, connections: int, base: str
) -> tuple[float, int]:
    """Requests/s and non-2xx count from wrk with generated bodies."""
    script = wrk_script(workload, base)
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
    try:
        out = subprocess.run(
            ["wrk", "-t2", f"-c{connections}", f"-d{seconds:g}s", "-s", f.name, url],
            capture_output=True, text=True, timeout=seconds + 60, check=True,
        ).stdout  # fmt: skip
    finally:
        os.unlink(f.name)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return rps, int(bad.group(1)) if bad else 0


async def python_rps(url: str, bodies: Bodies, workload: str, seconds: float,
                     connections: int) -> tuple[float, int]:  # fmt: skip
    """Requests/s with httpx when wrk is not installed (the client then limits it)."""
    make = bodies.varied if workload == "varied" else bodies.multi_turn
    done = errors = 0
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:

        async def user() -> None:
            nonlocal done, errors
            while time.perf_counter() < deadline:
                r = await client.post(
                    url, content=make(), headers={"content-type": "application/json"}
                )
                done += 1
                errors += r.status_code >= 300

        started = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(connections)))
    return done / (time.perf_counter() - started), errors


def measure(
    name: str, pod: str, workload: str, pairs: int, seconds: float, connections: int,
    prompt_bytes: int, use_wrk: bool, run: int = 0, speed: SpeedSampler | None = None,
) -> RouterResult:  # fmt: skip
    result = RouterResult(name, workload, run=run)
    window_start = time.monotonic()
    bodies = Bodies(prompt_bytes, seed=(hash(name) + 7919 * run) & 0xFFFF)  # fresh per run
    with router(name, pod) as url:
        diffs = asyncio.run(paired(pod, url, bodies, workload, pairs, stream=False))
        result.added_p50_ms, result.added_p99_ms = percentile(diffs, 50), percentile(diffs, 99)
        ttft = asyncio.run(paired(pod, url, bodies, workload, pairs // 2, stream=True))
        result.stream_ttft_added_ms = percentile(ttft, 50)
        target = f"{url}/v1/chat/completions"
        pid = getattr(url, "pid", 0)  # kvgate's (GatewayURL) or a peer's (PeerURL)
        cpu_before, started = process_cpu_s(pid), time.perf_counter()
        if use_wrk:
            result.rps, result.errors = wrk_rps(target, workload, seconds, connections,
                                                bodies.base)  # fmt: skip
        else:
            result.rps, result.errors = asyncio.run(
                python_rps(target, bodies, workload, seconds, connections)
            )
        served = result.rps * (time.perf_counter() - started)
        if pid and served > 0:
            result.cpu_ms = (process_cpu_s(pid) - cpu_before) / served * 1000
    machine = speed.median_ms(window_start, time.monotonic()) if speed is not None else None
    result.machine_ms = float("nan") if machine is None else machine
    return result


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (``--workers``) so far."""
    if not pid:
        return 0.0
    total = 0
    pids = [pid]
    with contextlib.suppress(OSError):
        pids += [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def run_overhead(
    routers: list[str],
    out: Path,
    pairs: int = 300,
    seconds: float = 8.0,
    connections: int = 32,
    prompt_bytes: int = 8192,
    console: Console | None = None,
    runs: int = 1,
) -> OverheadReport:
    """Measure every router (``runs`` rounds of all of them: a round measures each router
    once, so drift in the machine's speed falls on every router alike)."""
    console = console or Console(width=140)
    use_wrk = shutil.which("wrk") is not None
    if not use_wrk:
        console.print("[yellow]wrk not found (apt-get install wrk): requests/s are measured "
                      "with a Python client, which limits them")  # fmt: skip
    with zero_pod() as pod, SpeedSampler() as speed:
        base = Bodies(prompt_bytes).base
        if use_wrk:
            direct_rps, _ = wrk_rps(f"{pod}/v1/chat/completions", "varied", seconds,
                                    connections, base)  # fmt: skip
        else:
            direct_rps, _ = asyncio.run(python_rps(f"{pod}/v1/chat/completions",
                                                   Bodies(prompt_bytes), "varied", seconds,
                                                   connections))  # fmt: skip
        report = OverheadReport(direct_rps, connections, seconds, prompt_bytes, wrk=use_wrk,
                                runs=runs)  # fmt: skip
        cells = [(r, "varied") for r in routers]
        cells += [(r, "multi-turn") for r in routers if r.startswith("kvgate:")
                  and r.split(":")[1].split("@")[0] in ("kv-aware", "prefix-aware")]  # fmt: skip
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("routers", total=len(cells) * runs)
            for run, (name, workload) in ((k, c) for k in range(runs) for c in cells):
                progress.update(task, description=f"run {run + 1}/{runs}: {name} {workload}")
                try:
                    result = measure(name, pod, workload, pairs, seconds, connections,
                                     prompt_bytes, use_wrk, run, speed)  # fmt: skip
                except Exception as exc:  # a peer that will not install or start
                    said = str(exc).splitlines() or [type(exc).__name__]  # ReadTimeout: ""
                    result = RouterResult(name, workload, note=said[0][:120], run=run)
                report.results.append(result)
                progress.advance(task)
    print_report(report, console)
    write_report(report, out)
    return report


def print_report(report: OverheadReport, console: Console) -> None:
    table = Table(title=f"Router overhead, zero-latency backend, ~{report.prompt_bytes // 1024} KB "
                  f"chat bodies (direct: {report.direct_rps:,.0f} req/s)")  # fmt: skip
    several = report.runs > 1
    for col in ("run",) * several + ("router", "workload", "added p50 ms", "added p99 ms",
                "stream TTFT added ms", f"req/s @ {report.connections} conns", "CPU ms/req",
                "machine ms", "note"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("router", "workload", "note") else "right")
    for r in report.results:
        table.add_row(*(str(r.run + 1),) * several, r.router, r.workload,
                      f"{r.added_p50_ms:+.2f}", f"{r.added_p99_ms:+.2f}",
                      f"{r.stream_ttft_added_ms:+.2f}", f"{r.rps:,.0f}", _ms(r.cpu_ms),
                      _ms(r.machine_ms),
                      r.note or (f"{r.errors} non-2xx" if r.errors else ""))  # fmt: skip
    console.print(table)
    if several:
        console.print("\n".join(markdown(report.results, report.runs)), markup=False)


def _ms(value: float) -> str:
    """A ms column that may be unmeasured (NaN): empty then."""
    return f"{value:.2f}" if value == value else ""


def _medians(results: list[RouterResult]) -> list[RouterResult]:
    """One result per router and workload, each column its median over the runs."""
    return [RouterResult(router, workload, **{attr: m for attr, (m, _) in stats.items()})
            for (router, workload), stats in column_stats(results).items()]  # fmt: skip


def write_report(report: OverheadReport, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(asdict(report), indent=1))
    ok = [r for r in report.results if r.rps == r.rps]
    if report.runs > 1:
        ok = _medians(ok)
    labels = [f"{r.router}\n{r.workload}" for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, max(4.2, 0.45 * len(ok))))
    ax1.barh(labels, [r.added_p50_ms for r in ok], label="p50")
    ax1.barh(labels, [r.added_p99_ms - r.added_p50_ms for r in ok],
             left=[r.added_p50_ms for r in ok], alpha=0.5, label="p99")  # fmt: skip
    ax1.set_xlabel("latency added (ms)")
    ax1.legend(fontsize=8)
    ax2.barh(labels, [r.rps for r in ok])
    ax2.axvline(report.direct_rps, color="k", linestyle="--", label="direct")
    ax2.set_xlabel(f"requests/s at {report.connections} connections"
                   + (f" (median of {report.runs} runs)" if report.runs > 1 else ""))  # fmt: skip
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=110)
    plt.close(fig)
    lines = [
        "# Router overhead",
        "",
        f"Zero-latency backend (`bench/zero_pod.py`), ~{report.prompt_bytes} B chat bodies; "
        f"added latency from {len(report.results) and 'paired'} sequential requests; "
        f"requests/s from {'wrk' if report.wrk else 'a Python client'} with "
        f"{report.connections} connections for {report.seconds:g} s. Direct: "
        f"{report.direct_rps:,.0f} req/s.",
        "",
        "| run | router | workload | added p50 ms | added p99 ms | stream TTFT added ms | "
        "req/s | CPU ms/req | machine ms | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {r.run + 1} | {r.router} | {r.workload} | {r.added_p50_ms:+.2f} | "
          f"{r.added_p99_ms:+.2f} | {r.stream_ttft_added_ms:+.2f} | {r.rps:,.0f} | "
          f"{_ms(r.cpu_ms)} | {_ms(r.machine_ms)} | "
          f"{r.note or (f'{r.errors} non-2xx' if r.errors else '')} |"
          for r in report.results),
        "",
        "*CPU ms/req*: the router's process (kvgate: all its workers) per request during the "
        "req/s run; "
        "with N workers on N free cores, req/s can reach about N x 1000 / it. *machine ms*: "
        "the median CPU ms of a fixed loop sampled every 0.25 s while the row was measured "
        "(`bench/machine_speed.py`; this VM runs it in ~0.85 ms at its fast speed and ~1.4 "
        "at its slow one): every CPU cost above follows it.",
        "",
        "![overhead](overhead.png)",
    ]  # fmt: skip
    if report.runs > 1:
        lines[-1:-1] = [*markdown(report.results, report.runs), ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
