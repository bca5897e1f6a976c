"""bench.gpu_timing's fits, and the H200 profile against the measurement it cites."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu_timing import fit_line, summary_lines, worst_relative_residual
from bench.profiles import H200_MEASUREMENT, get_profile

REPO = Path(__file__).resolve().parents[2]


def _measurement() -> dict:
    return json.loads((REPO / H200_MEASUREMENT).read_text())


def test_fit_line_recovers_an_exact_line():
    intercept, slope = fit_line([(0, 1.0), (10, 6.0), (20, 11.0)])
    assert intercept == pytest.approx(1.0)
    assert slope == pytest.approx(0.5)


def test_fit_line_refuses_what_fixes_no_line():
    with pytest.raises(ValueError, match="two points"):
        fit_line([(1, 1.0)])
    with pytest.raises(ValueError, match="different x"):
        fit_line([(1, 1.0), (1, 2.0)])


def test_worst_relative_residual_is_the_largest_miss_over_the_measured_value():
    # Line y = x; the point (2, 4) is missed by 2, half of what was measured.
    assert worst_relative_residual([(1, 1.0), (2, 4.0)], 0.0, 1.0) == pytest.approx(0.5)


def test_h200_profile_takes_its_measured_numbers_from_the_recorded_run():
    measured = _measurement()
    timing = get_profile("h200-llama8b").timing
    prefill = measured["prefill_fit"]
    assert timing.overhead_s == pytest.approx(prefill["intercept_s"], abs=1e-4)
    assert timing.prefill_tokens_per_s == pytest.approx(1 / prefill["slope_s"], rel=0.01)
    host = measured["host_to_gpu_fit"]
    assert timing.l1.latency_s == pytest.approx(host["intercept_s"], abs=1e-5)
    assert timing.l1.bandwidth_bytes_per_s == pytest.approx(1 / host["slope_s"], rel=0.01)
    # A decode step can never beat reading the weights once at the measured bandwidth.
    assert timing.itl_s(1) >= measured["decode_floor_s"]
    assert timing.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_the_recorded_run_is_a_gpu_run_of_the_llama_shape():
    measured = _measurement()
    assert "H200" in measured["gpu"]
    assert measured["shape"]["num_hidden_layers"] == 32
    assert measured["page_cache_dropped"] is True
    tokens = [row["tokens"] for row in measured["prefill"]]
    assert tokens == sorted(tokens) and tokens[-1] == 8192


def test_summary_lines_state_the_fits_in_the_cost_models_terms():
    text = "\n".join(summary_lines(_measurement()))
    assert "NVIDIA H200" in text
    assert "37,423 tokens/s" in text
    assert "host DRAM (pinned) -> GPU: latency 0.17 ms, 55.1 GB/s" in text
    assert "512 new behind  8192 cached" in text


def test_report_of_a_recorded_run_rewrites_its_summary_and_plot(tmp_path):
    from bench.gpu_timing import main

    recorded = tmp_path / "gpu_timing.json"
    recorded.write_text((REPO / H200_MEASUREMENT).read_text())
    assert main(["--report", str(recorded)]) == 0
    summary = (tmp_path / "summary.txt").read_text()
    assert summary == (REPO / H200_MEASUREMENT).with_name("summary.txt").read_text()
    assert (tmp_path / "gpu_timing.png").read_bytes()[:4] == b"\x89PNG"
