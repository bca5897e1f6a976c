"""Arguments of ``kvgate bench fleet`` and ``kvgate bench quick``."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.peers import PEERS


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in _csv(text)]


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a number above 0")
    return value


def add_fleet(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fleet",
        help="routers x tier setups x load over a workload, fresh pods per cell; report + plots",
        description="Starts N simulated pods (or uses --pods-url) and a router per cell: each "
        "kvgate strategy and each --peer. Writes report.md, results.json and PNG plots.",
    )
    p.add_argument("--preset", choices=["quick", "docs", "tiny"], default="quick",
                   help="sizes, pod timing and defaults below (default: quick)")  # fmt: skip
    p.add_argument("--workloads", type=_csv, help="rag,prefix,chat,trace (default: preset's)")
    p.add_argument("--routers", type=_csv, help="kvgate strategies (default: the four)")
    p.add_argument("--peer", action="append", default=[], choices=sorted(PEERS),
                   help="also run this router (installed on demand); repeatable; replaces "
                   "the preset's peers")  # fmt: skip
    p.add_argument("--no-peers", action="store_true", help="run none of the preset's peers")
    p.add_argument("--tiers", type=_csv, help="L0,L0+L1,L0+L1+L2 (default: preset's)")
    p.add_argument("--load", action="append", default=[],
                   help="closed:USERS or poisson:QPS; repeatable (default: preset's)")  # fmt: skip
    p.add_argument("--pods", type=int, help="simulated pods (default: preset's)")
    p.add_argument("--pods-url", nargs="+", default=[], metavar="URL",
                   help="real pods instead: URL[,events=tcp://..,replay=tcp://..]")  # fmt: skip
    p.add_argument("--profile", help="simulated hardware profile (bench/profiles.py)")
    p.add_argument("--l1-capacity-blocks", type=int, help="L1 size per pod when L1 is on")
    p.add_argument("--requests", type=int, help="requests per workload (default: preset's)")
    p.add_argument("--trace", type=Path, help="Mooncake JSONL (default: the shared one)")
    p.add_argument("--prefix-k", type=positive_float,
                   help="prefix workload: its prefixes' tokens as a multiple of the fleet's "
                   "L0 (default: the preset's 0.75; above 1 they spill into L1/L2)")  # fmt: skip
    p.add_argument("--rag-k", type=positive_float,
                   help="RAG workload: its documents' tokens as a multiple of the fleet's L0 "
                   "(default: 12 documents, ~0.7x)")  # fmt: skip
    p.add_argument("--redis", action="store_true", help="kvgate's index in a real redis-server")
    p.add_argument("--workers", type=int, default=1, help="worker processes per kvgate replica")
    p.add_argument("--gateways", type=_ints, metavar="N[,N...]",
                   help="scale-out report: kvgate over N replicas (e.g. 1,2,4,8), requests "
                   "spread at random like a Kubernetes Service; kv-aware unless --routers; "
                   "no peers")  # fmt: skip
    p.add_argument("--sharing", type=_csv, default=["memory", "redis"],
                   help="with --gateways: memory (each replica its own index and load), "
                   "redis (shared index and load); default both")  # fmt: skip
    p.add_argument("--seeds", type=_ints, help="with --gateways: one run per seed, medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("reports/fleet"))
    p.add_argument("--doc", type=Path, help="also write the report here (docs/BENCHMARKS.md)")
    p.set_defaults(bench_func=run_fleet_cli)


def add_quick(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quick",
        help="the quick fleet benchmark: RAG + shared-prefix, round-robin vs kv-aware vs "
        "sglang-router and vllm-router, ~7 minutes on 2 cores",
        description="kvgate bench fleet --preset quick (see bench/quick.py). The peers are "
        "installed on first use into ~/.cache/kvgate/peers (KVGATE_PEERS_HOME) from PyPI.",
    )
    p.add_argument("--peer", action="append", default=[], choices=sorted(PEERS),
                   help="run only these peers (repeatable; default: all of them)")  # fmt: skip
    p.add_argument("--no-peers", action="store_true", help="kvgate's routers only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("reports/quick"))
    p.set_defaults(bench_func=run_quick_cli)


def run_quick_cli(args: argparse.Namespace) -> int:
    from bench.quick import run_quick

    cells = run_quick(args.out, seed=args.seed, peers=_peers(args))
    return 0 if all(c.summary is None or c.summary.errors == 0 for c in cells) else 1


def _peers(args: argparse.Namespace) -> list[str] | None:
    """``--peer`` list, or none with ``--no-peers``, or None: the preset's."""
    if args.peer and args.no_peers:
        raise SystemExit("--peer and --no-peers contradict each other")
    return list(args.peer) if args.peer else [] if args.no_peers else None


def run_fleet_cli(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from bench.fleet import Load
    from bench.quick import PRESETS, build_workloads, plan_from_preset, run_and_report

    preset = PRESETS[args.preset]
    peers = _peers(args)
    changes = {
        k: v
        for k, v in {
            "workloads": tuple(args.workloads) if args.workloads else None,
            "tiers": tuple(args.tiers) if args.tiers else None,
            "loads": tuple(args.load) if args.load else None,
            "pods": args.pods,
            "requests": args.requests,
            "l1_capacity_blocks": args.l1_capacity_blocks,
            "prefix_k": args.prefix_k,
            "rag_k": args.rag_k,
            "routers": tuple(args.routers) if args.routers else None,
            "peers": tuple(peers) if peers is not None else None,
        }.items()
        if v is not None
    }
    preset = replace(preset, **changes)
    for text in preset.loads:
        Load.parse(text)  # fail fast on a typo, before any pod starts
    plan = plan_from_preset(preset, seed=args.seed)
    if args.trace is not None:
        plan.workloads = build_workloads(
            list(preset.workloads), preset, preset.pods, args.seed, args.trace
        )
    plan.pods_url = list(args.pods_url)
    plan.profile = args.profile
    plan.redis = args.redis
    plan.workers = args.workers
    if args.gateways:
        return _run_scaleout(args, preset, plan)
    cells = run_and_report(plan, args.out)
    if args.doc is not None:
        from bench.report import write_benchmarks_doc

        print(f"doc: {write_benchmarks_doc(args.out / 'report.md', args.doc)}")
    return 0 if all(c.summary is None or c.summary.errors == 0 for c in cells) else 1


def _run_scaleout(args: argparse.Namespace, preset: object, plan: object) -> int:
    import shlex
    import sys
    from dataclasses import replace

    from bench.quick import plan_from_preset
    from bench.scaleout import SHARING, run_scaleout

    unknown = set(args.sharing) - set(SHARING)
    if unknown:
        raise SystemExit(f"--sharing: unknown {sorted(unknown)}; choose from {list(SHARING)}")
    routers = list(args.routers) if args.routers else ["kv-aware"]

    def make_plan(seed: int):  # noqa: ANN202
        seeded = plan_from_preset(replace(preset, peers=()), seed=seed)  # type: ignore[type-var]
        seeded.routers = routers
        seeded.pods_url, seeded.profile = plan.pods_url, plan.profile  # type: ignore[attr-defined]
        seeded.workers = args.workers
        return seeded

    command = "kvgate bench " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    seeds = args.seeds or [args.seed]
    cells = run_scaleout(make_plan(seeds[0]), args.gateways, args.sharing, seeds, args.out,
                         command, make_plan)  # fmt: skip
    return 0 if all(c.summary is None or c.summary.errors == 0 for c in cells) else 1
