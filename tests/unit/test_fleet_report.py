"""Fleet report without running a fleet: the peer comparison, peer tiers, quick's peers,
and docs/BENCHMARKS.md's sections."""

import argparse

import pytest

from bench.fleet import Cell, FleetPlan, Load, run_fleet
from bench.fleet_cli import _peers
from bench.quick import PRESETS
from bench.report import (
    headline_rows,
    headlines,
    peer_rows,
    render,
    versus,
    write_benchmarks_doc,
    write_doc_section,
)
from bench.summary import RunSummary
from bench.workloads import Workload


def cell(router: str, p90: float, tiers: str = "L0", cached: float = 0.9) -> Cell:
    s = RunSummary(router, 400, 0, p90 / 2, p90, p90 * 2, p90 / 2, p90, cached, {}, 35.0)
    return Cell("rag", tiers, "12 qps", router, summary=s)


def test_versus_says_ahead_or_behind_with_a_ratio_above_one():
    assert versus(50.0, 100.0) == "kv-aware 2.00x ahead"
    assert versus(100.0, 80.0) == "kv-aware 1.25x behind"
    assert versus(70.0, 70.0) == "kv-aware 1.00x ahead"


def test_peer_rows_compare_each_peer_with_kv_aware_on_the_same_cell_only():
    cells = [
        cell("round-robin", 1000.0),
        cell("kv-aware", 80.0, cached=0.93),
        cell("sglang-router", 96.0, cached=0.94),
        cell("vllm-router", 40.0),
        cell("kv-aware", 50.0, tiers="L0+L1+L2"),
        Cell("rag", "L0+L1+L2", "12 qps", "sglang-router", skipped="not run: peers on L0 only"),
    ]
    assert peer_rows(cells) == [
        ["rag", "L0", "12 qps", "80", "sglang-router", "96", "kv-aware 1.20x ahead", "93%", "94%"],
        ["rag", "L0", "12 qps", "80", "vllm-router", "40", "kv-aware 2.00x behind", "93%", "90%"],
    ]
    head = headline_rows(headlines(cells))
    assert head[0][5] == "12.5x"
    assert head[0][7] == (
        "vllm-router: p90 40 ms, kv-aware 2.00x behind; sglang-router: p90 96 ms, "
        "kv-aware 1.20x ahead"
    )
    assert head[1][7].startswith("sglang-router: not run")
    plan = FleetPlan(workloads=[])
    text = render(cells, plan, {"command": "x"}, {}, {"rag": "docs"})
    assert "## kv-aware vs peers" in text and "kv-aware 2.00x behind" in text


def test_peers_outside_peer_tiers_are_reported_not_run():
    plan = FleetPlan(
        workloads=[Workload("rag", [])],
        routers=["sglang-router", "vllm-router"],
        tiers=["L0+L1+L2"],
        loads=[Load("poisson", 12)],
        peer_tiers=["L0"],
    )
    cells = run_fleet(plan)  # nothing starts: every cell is left out by the plan
    assert [(c.router, c.summary, c.skipped) for c in cells] == [
        (r, None, "not run: this plan runs peers on L0 only") for r in plan.routers
    ]


def test_quick_runs_both_peers_on_l0_unless_told_otherwise():
    quick = PRESETS["quick"]
    assert (quick.peers, quick.peer_tiers) == (("sglang-router", "vllm-router"), ("L0",))
    assert PRESETS["docs"].peers == () and PRESETS["docs"].peer_tiers is None

    def args(peer: list[str], no_peers: bool) -> argparse.Namespace:
        return argparse.Namespace(peer=peer, no_peers=no_peers)

    assert _peers(args([], False)) is None  # the preset's
    assert _peers(args([], True)) == []
    assert _peers(args(["vllm-router"], False)) == ["vllm-router"]


def test_a_doc_section_is_appended_once_then_replaced_in_place(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nfleet numbers\n")
    write_doc_section(doc, "admission", "## Admission\n\nfirst run\n")
    write_doc_section(doc, "other", "## Other\n")
    write_doc_section(doc, "admission", "## Admission\n\nsecond run\n")
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nfleet numbers\n")
    assert "first run" not in text and text.count("second run") == 1
    assert text.index("second run") < text.index("## Other")


def test_rewriting_the_fleet_report_keeps_the_other_sections(tmp_path):
    report = tmp_path / "bench" / "report.md"
    report.parent.mkdir()
    report.write_text("# kvgate fleet benchmark\n\nnew fleet numbers ![p](cdf.png)\n")
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nold fleet numbers\n")
    write_doc_section(doc, "admission", "## Admission\n\nkept\n")
    write_benchmarks_doc(report, doc)
    text = doc.read_text()
    assert "old fleet numbers" not in text and "new fleet numbers ![p](bench/cdf.png)" in text
    assert text.count("<!-- kvgate-section:admission -->\n## Admission\n\nkept\n") == 1


def test_failed_requests_say_what_went_wrong_in_the_summary_and_the_report():
    from bench.loadgen import RequestResult
    from bench.summary import MAX_ERROR_KINDS, summarize

    ok = [RequestResult(i, True, pod="pod-0", ttft_s=0.05, e2e_s=0.1) for i in range(10)]
    reset = "RemoteProtocolError: peer closed connection without sending complete message body"
    failed = [RequestResult(10 + i, False, error=reset) for i in range(3)]
    failed += [RequestResult(20 + i, False, error=f"APIStatusError: {i}") for i in range(9)]
    failed.append(RequestResult(30, False))
    odd = "ReadError: `x`\n  second line"  # a code span and a list item on one line
    failed += [RequestResult(40 + i, False, error=odd) for i in range(2)]
    s = summarize("round-robin", ok + failed, 1.0)
    assert s.errors == 15
    # The most frequent first, at most MAX_ERROR_KINDS of them: a flood stays one line.
    assert list(s.error_kinds.items())[:2] == [(reset, 3), (odd, 2)]
    assert len(s.error_kinds) == MAX_ERROR_KINDS
    assert sum(s.error_kinds.values()) == 3 + 2 + MAX_ERROR_KINDS - 2
    text = render([Cell("rag", "L0", "12 qps", "round-robin", summary=s)],
                  FleetPlan(workloads=[]), {"command": "x"}, {}, {"rag": "docs"})  # fmt: skip
    assert f"- round-robin, L0, 12 qps: 3 x `{reset}`" in text
    assert "- round-robin, L0, 12 qps: 2 x `ReadError: 'x' second line`" in text
    quiet = summarize("kv-aware", ok, 1.0)
    assert quiet.error_kinds == {}
    assert "Failed requests" not in render([Cell("rag", "L0", "12 qps", "kv-aware", summary=quiet)],
                                           FleetPlan(workloads=[]), {"command": "x"}, {},
                                           {"rag": "docs"})  # fmt: skip


def test_a_cell_line_prints_its_errors_as_the_client_wrote_them():
    from rich.console import Console

    from bench.loadgen import RequestResult
    from bench.quick import print_cell
    from bench.summary import summarize

    message = "APIStatusError: Error code: 502 - [bold]{'error': 'upstream'}[/bold]"
    s = summarize("round-robin", [RequestResult(0, False, error=message)], 1.0)
    console = Console(record=True, width=200)
    print_cell(Cell("rag", "L0", "12 qps", "round-robin", summary=s), console)
    assert f"1 x {message}" in console.export_text()  # rich markup in it left as text


def test_a_doc_section_name_its_markers_cannot_match_is_refused(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    with pytest.raises(ValueError, match="letters, digits, _ and - only"):
        write_doc_section(doc, "two words", "## A table\n")
    assert not doc.exists()
