"""bench.gpu_timing's fits, and the H200 profile against the measurements it cites."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench.gpu_timing import fit_line, summary_lines, worst_relative_residual
from bench.profiles import H200_MEASUREMENTS, get_profile

REPO = Path(__file__).resolve().parents[2]


def _measurements() -> list[dict]:
    return [json.loads((REPO / path).read_text()) for path in H200_MEASUREMENTS]


def test_fit_line_recovers_an_exact_line():
    intercept, slope = fit_line([(0, 1.0), (10, 6.0), (20, 11.0)])
    assert intercept == pytest.approx(1.0)
    assert slope == pytest.approx(0.5)


def test_fit_line_refuses_what_fixes_no_line():
    with pytest.raises(statistics.StatisticsError):
        fit_line([(1, 1.0)])
    with pytest.raises(statistics.StatisticsError):
        fit_line([(1, 1.0), (1, 2.0)])


def test_worst_relative_residual_is_the_largest_miss_over_the_measured_value():
    # Line y = x; the point (2, 4) is missed by 2, half of what was measured.
    assert worst_relative_residual([(1, 1.0), (2, 4.0)], 0.0, 1.0) == pytest.approx(0.5)


def test_h200_profile_lies_within_what_the_two_recorded_runs_measured():
    runs = _measurements()
    timing = get_profile("h200-llama8b").timing
    rates = [1 / run["prefill_fit"]["slope_s"] for run in runs]
    assert min(rates) * 0.98 <= timing.prefill_tokens_per_s <= max(rates) * 1.02
    # The fixed cost: above the compute line's intercept, below the eager floor.
    intercepts = [run["prefill_fit"]["intercept_s"] for run in runs]
    floors = [run["prefill"][0]["seconds"] for run in runs]
    assert max(intercepts) < timing.overhead_s < min(floors)
    l1 = [run["host_to_gpu_fit"] for run in runs]
    bandwidths = [1 / fit["slope_s"] for fit in l1]
    assert min(bandwidths) * 0.98 <= timing.l1.bandwidth_bytes_per_s <= max(bandwidths) * 1.02
    assert timing.l1.latency_s >= min(fit["intercept_s"] for fit in l1)
    # Each cached token: the slope of flash attention's time over the cached count.
    slopes = []
    for run in runs:
        layers = run["shape"]["num_hidden_layers"]
        flash = [(r["cached_tokens"], r["seconds_per_layer"] * layers)
                 for r in run.get("attention_behind_cache", [])
                 if r["kernel"] == "flash"]  # fmt: skip
        if flash:
            slopes.append(fit_line(flash)[1])
    assert len(slopes) == 2
    assert min(slopes) <= timing.prefill_s_per_cached_token <= max(slopes)
    # The decode step: the CUDA-graph replay's line (run 3).
    graphed = runs[2]["graphed_decode_fit"]
    assert timing.itl_base_s == pytest.approx(graphed["intercept_s"], rel=0.02)
    assert all(r["graphed"] for r in runs[2]["graphed_decode"])
    # A decode step can never beat reading the weights once at the measured bandwidth.
    assert timing.itl_s(1) >= max(run["decode_floor_s"] for run in runs)
    assert timing.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_the_recorded_runs_are_gpu_runs_of_the_llama_shape():
    for run in _measurements():
        assert "H200" in run["gpu"]
        assert run["shape"]["num_hidden_layers"] == 32
        assert run["page_cache_dropped"] is True
        tokens = [row["tokens"] for row in run["prefill"]]
        assert tokens == sorted(tokens) and tokens[-1] == 8192
        assert run["prefill_fit"]["tokens"] == [1024, 4096]


def test_summary_lines_state_the_fits_in_the_cost_models_terms():
    first, second, third = ("\n".join(summary_lines(run)) for run in _measurements())
    assert "NVIDIA H200" in first
    assert "33,474 tokens/s (line through 1024-4096 tokens" in first
    assert "host DRAM (pinned) -> GPU: latency 0.17 ms, 55.1 GB/s" in first
    # Only the second run timed attention alone and prefills batched together.
    assert "attention alone" not in first
    assert "attention alone,  flash, 512 new behind  8192 cached, x 32 layers: 11.43 ms" in second
    assert "2 x 2048 117.2 ms, 1 x 4096 123.8 ms" in second
    # Only the third replayed a decode step as a CUDA graph.
    assert "replayed as a CUDA graph" not in second
    assert "line 5.74 ms + 34.8 us per sequence" in third


def test_report_of_a_recorded_run_rewrites_its_summary_and_plot(tmp_path):
    from bench.gpu_timing import main

    for path in H200_MEASUREMENTS:
        recorded = tmp_path / "gpu_timing.json"
        recorded.write_text((REPO / path).read_text())
        assert main(["--report", str(recorded)]) == 0
        summary = (tmp_path / "summary.txt").read_text()
        assert summary == (REPO / path).with_name("summary.txt").read_text()
        assert (tmp_path / "gpu_timing.png").read_bytes()[:4] == b"\x89PNG"
