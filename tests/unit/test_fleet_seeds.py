"""kvgate bench seeds: fleet runs of several seeds as medians."""

import json

import pytest

from bench.fleet_seeds import load_runs, over_seeds, render
from cli.main import main


def run_dir(tmp_path, seed, p90s, tier_tokens=None):
    """A fleet run's results.json; ``tier_tokens``: per tier, the prompt tokens (of 1,000)
    it served, as simulated pods report them."""
    d = tmp_path / f"seed-{seed}"
    d.mkdir()
    stats = {"pod_ttft_sum_s": 2.0, "pod_ttft_count": 40}
    if tier_tokens is not None:
        stats |= {"prompt_tokens": 1000, "tier_tokens": tier_tokens, "tiers_reported": True}
    cells = [{"workload": "rag", "tiers": "L0+L1+L2", "load": "12 qps", "router": router,
              "skipped": "", "summary": {"ttft_p90_ms": p90, "cached_ratio": 0.9},
              "stats": stats}
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


def test_the_tiers_share_of_prompt_tokens_is_a_median_over_seeds(tmp_path):
    dirs = [run_dir(tmp_path, 0, {"kv-aware": 80}, {"L0": 600, "L1": 300, "L2": 0}),
            run_dir(tmp_path, 1, {"kv-aware": 90}, {"L0": 200, "L1": 650, "L2": 50}),
            run_dir(tmp_path, 2, {"kv-aware": 85}, {"L0": 400, "L1": 400, "L2": 100})]  # fmt: skip
    (row,) = over_seeds(load_runs(dirs))
    assert row.tier_shares == {"L0": 0.4, "L1": 0.4, "L2": 0.05}
    assert "| 85 | 90 | 90.0% | 50 | L0 40% / L1 40% / L2 5% |" in render([row], "cmd")


def test_a_tier_a_seed_does_not_name_served_it_nothing(tmp_path):
    dirs = [run_dir(tmp_path, 0, {"kv-aware": 80}, {"L0": 600, "L2": 300}),
            run_dir(tmp_path, 1, {"kv-aware": 90}, {"L0": 700}),
            run_dir(tmp_path, 2, {"kv-aware": 85}, {"L0": 800, "L2": 100})]  # fmt: skip
    (row,) = over_seeds(load_runs(dirs))
    assert row.tier_shares == {"L0": 0.7, "L2": 0.1}


def test_pods_that_report_no_tiers_leave_the_column_empty(tmp_path):
    dirs = [run_dir(tmp_path, 0, {"kv-aware": 80}, {"L0": 600, "L1": 300, "L2": 0}),
            run_dir(tmp_path, 1, {"kv-aware": 90})]  # fmt: skip
    (row,) = over_seeds(load_runs(dirs))
    assert row.tier_shares is None
    assert render([row], "cmd").count("| 50 | n/a |") == 1


def test_a_named_section_with_its_own_title_leaves_the_default_one(tmp_path, capsys):
    doc = tmp_path / "BENCHMARKS.md"
    first = run_dir(tmp_path, 0, {"kv-aware": 80, "sglang-router": 100})
    assert main(["bench", "seeds", str(first), "--doc", str(doc)]) == 0
    second = tmp_path / "k4"
    second.mkdir()
    other = run_dir(second, 0, {"kv-aware": 60, "sglang-router": 120})
    args = ["bench", "seeds", str(other), "--doc", str(doc), "--section", "tiers-k4",
            "--title", "Shared prefixes at 4x the fleet's L0"]  # fmt: skip
    assert main(args) == 0

    text = doc.read_text()
    default = text[text.index("<!-- kvgate-section:fleet-over-seeds -->") :]
    named = text[text.index("<!-- kvgate-section:tiers-k4 -->") :]
    assert default.index("## Fleet over seeds") < default.index("| 0.80 | 80 / 100 |")
    assert named.index("## Shared prefixes at 4x the fleet's L0") < named.index(
        "| 0.50 | 60 / 120 |"
    )
    assert text.count("<!-- /kvgate-section:") == 2


def test_a_section_name_its_markers_could_not_find_is_refused(tmp_path, capsys):
    run = run_dir(tmp_path, 0, {"kv-aware": 80})
    doc = tmp_path / "BENCHMARKS.md"
    with pytest.raises(SystemExit):
        main(["bench", "seeds", str(run), "--doc", str(doc), "--section", "two words"])
    assert "letters, digits, _ and - only" in capsys.readouterr().err
    assert not doc.exists()
