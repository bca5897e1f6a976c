"""A tiny fleet run writes the report directory: markdown rows, PNG plots, JSON."""

from __future__ import annotations

import json

import pytest

from bench.fleet import FleetPlan, Load, run_fleet, tier_overrides
from bench.report import write_report
from bench.tinymodel import ensure_tokenizer
from bench.workloads import rag_workload

POD = {
    "overhead_s": 0.005,
    "prefill_tokens_per_s": 20_000.0,
    "itl_s": 0.002,
    "l0_capacity_blocks": 256,
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    plan = FleetPlan(
        workloads=[rag_workload(ensure_tokenizer(), docs=3, doc_tokens=600, requests=20, seed=1)],
        routers=["round-robin", "kv-aware"],
        tiers=["L0"],
        loads=[Load("closed", 4)],
        pods=2,
        pod_config=POD,
    )
    cells = run_fleet(plan)
    write_report(cells, plan, out, "pytest tiny fleet")
    return cells, out


def test_every_router_ran_every_request_without_errors(tiny_run):
    cells, _ = tiny_run
    assert [(c.router, c.summary.requests, c.summary.errors) for c in cells] == [
        ("round-robin", 20, 0),
        ("kv-aware", 20, 0),
    ]
    rr = cells[0].summary
    assert sorted(rr.per_pod) == ["pod-0", "pod-1"]  # the gateway's names for the pods


def test_pods_report_the_cached_tokens_the_clients_saw(tiny_run):
    cells, _ = tiny_run
    for c in cells:
        assert c.stats is not None and c.stats.pod_ttft_count == 20
        assert c.stats.tier_rate("L0") == pytest.approx(c.summary.cached_ratio, abs=0.02)
        assert c.stats.tier_rate("L2") is None  # no L2 in this setup
        assert c.decision_ms is not None and c.decision_ms > 0


def test_report_markdown_has_a_row_per_router_and_links_existing_pngs(tiny_run):
    _, out = tiny_run
    text = (out / "report.md").read_text()
    assert "| round-robin | L0 | 4 users | 20 | 0 (0%) |" in text
    assert "| kv-aware | L0 | 4 users | 20 | 0 (0%) |" in text
    assert "| rag | L0 | 4 users |" in text  # the headline row
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["tier_hits_rag.png", "ttft_cdf_rag_l0_4-users.png"]
    for name in pngs:
        assert f"]({name})" in text
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_json_holds_the_cells_and_environment(tiny_run):
    _, out = tiny_run
    data = json.loads((out / "results.json").read_text())
    assert [c["router"] for c in data["cells"]] == ["round-robin", "kv-aware"]
    assert data["environment"]["seed"] == "0"
    assert data["environment"]["command"] == "pytest tiny fleet"


def test_unknown_tier_setup_is_reported_not_run(tmp_path):
    plan = FleetPlan(workloads=[])
    assert tier_overrides("L9", plan, tmp_path) == "unknown tier setup 'L9'"
