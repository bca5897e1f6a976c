"""The DES beside a ``kvgate bench real`` run: each cell's decode time and TTFT.

    python -m bench.des.decode_check reports/real-s30a [--decode-step-ms 4.7]

For every cell and router of the run that the DES can route itself (kvgate's
strategies), the run's own prompts and arrivals (``bench.des.real_cells``) on simulated
pods timed by the run's fit, over the run's seeds; beside them what the real pods
did (``requests.jsonl``). *decode*: a request's end minus its first token, the time
its other answer tokens took. ``--decode-step-ms`` stands in for a fit from before the
decode step was measured (``kvgate bench calibrate`` prints it). Prints p10, p50 and
p90 of each, in ms, pooled over the seeds.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from bench.des import real_cells
from bench.des.sim import run_des
from routing.strategy_registry import canonical_name

QUANTILES = (0.1, 0.5, 0.9)


def _quantiles(values: list[float]) -> str:
    ordered = sorted(values)
    return " ".join(f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:6.0f}"
                    for q in QUANTILES)  # fmt: skip


def compare(run: Path, decode_step_s: float | None = None) -> list[str]:
    """One line per cell and router: the DES's decode and TTFT quantiles, then the real
    pods'."""
    results = json.loads((run / "results.json").read_text())
    fit = real_cells.load_fit(run / "results.json")
    if decode_step_s is not None:
        fit = replace(fit, decode_step_s=decode_step_s)
    spec = real_cells.real_pod_spec(fit)
    real = [json.loads(line) for line in (run / "requests.jsonl").read_text().splitlines()]
    rates = {f"{c['workload']}@{c['load']}": c.get("rate_rps") for c in results["cells"]}
    routers = [r for r in results["plan"]["routers"] if "/" not in r and ":" not in r]
    lines = [f"{'cell':30s} {'router':13s} {'decode p10/p50/p90: DES':>24s} {'real':>20s}"
             f" {'TTFT p10/p50/p90: DES':>24s} {'real':>20s}"]  # fmt: skip
    for cell, rate in rates.items():
        for router in routers:
            options = (
                real_cells.kv_aware_options(fit) if canonical_name(router) == "kv-aware" else None
            )
            decode, ttft = [], []
            for seed in results["plan"]["seeds"]:
                inp = real_cells.cell_input(cell, seed, router, rate)
                done = run_des(inp.requests, results["plan"]["pods"], router, spec,
                               concurrency=inp.concurrency, strategy_options=options,
                               seed=seed)  # fmt: skip
                decode += [(r.e2e_s - r.ttft_s) * 1000 for r in done]
                ttft += [r.ttft_s * 1000 for r in done]
            rows = [r for r in real if r["cell"] == cell and r["router"] == router and r["ok"]]
            if not rows:
                continue
            real_decode = [r["e2e_ms"] - r["ttft_ms"] for r in rows]
            lines.append(f"{cell:30s} {router:13s} {_quantiles(decode):>24s} "
                         f"{_quantiles(real_decode):>20s} {_quantiles(ttft):>24s} "
                         f"{_quantiles([r['ttft_ms'] for r in rows]):>20s}")  # fmt: skip
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path, help="a kvgate bench real --out folder")
    p.add_argument("--decode-step-ms", type=float, default=None)
    args = p.parse_args()
    step = None if args.decode_step_ms is None else args.decode_step_ms / 1000
    print("\n".join(compare(args.run, step)))


if __name__ == "__main__":
    main()
