"""kvgate bench seeds: fleet runs of several seeds as medians."""

import json

from bench.fleet_seeds import load_runs, over_seeds, render


def run_dir(tmp_path, seed, p90s):
    d = tmp_path / f"seed-{seed}"
    d.mkdir()
    cells = [{"workload": "rag", "tiers": "L0+L1+L2", "load": "12 qps", "router": router,
              "skipped": "", "summary": {"ttft_p90_ms": p90, "cached_ratio": 0.9},
              "stats": {"pod_ttft_sum_s": 2.0, "pod_ttft_count": 40}}
             for router, p90 in p90s.items()]  # fmt: skip
    cells.append({"workload": "rag", "tiers": "L0", "load": "12 qps", "router": "kv-aware",
                  "skipped": "router unavailable", "summary": None})  # fmt: skip
    (d / "results.json").write_text(json.dumps({"environment": {"seed": seed}, "cells": cells}))
    return d


def test_medians_and_worsts_over_seeds_and_kv_aware_against_each_peer(tmp_path):
    dirs = [run_dir(tmp_path, 0, {"kv-aware": 80, "sglang-router": 100}),
            run_dir(tmp_path, 1, {"kv-aware": 90, "sglang-router": 70}),
            run_dir(tmp_path, 2, {"kv-aware": 120, "sglang-router": 90})]  # fmt: skip
    rows = {r.router: r for r in over_seeds(load_runs(dirs))}
    assert set(rows) == {"kv-aware", "sglang-router"}  # the skipped cell is left out
    kv, peer = rows["kv-aware"], rows["sglang-router"]
    assert (kv.seeds, kv.p90_median_ms, kv.p90_worst_ms) == (3, 90, 120)
    assert (peer.p90_median_ms, peer.p90_worst_ms, peer.pod_ttft_median_ms) == (90, 100, 50)
    assert "| rag | L0+L1+L2 | 12 qps | sglang-router | 1.00 | 120 / 100 |" in render(
        list(rows.values()), "cmd"
    )
