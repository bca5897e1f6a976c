"""bench.gpu_timing end to end on the CPU (``--tiny``), in the vLLM venv that has torch.

The GPU run itself needs a machine this suite never has; this checks that the
script it would run measures every point and writes what the profile cites.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tiny_run_measures_every_point_and_writes_its_summary(
    vllm_venv_python: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [str(vllm_venv_python), "-m", "bench.gpu_timing", "--tiny", "--reps", "1",
         "--out", str(out), "--scratch", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "gpu_timing.json").read_text())
    assert [r["tokens"] for r in result["prefill"]] == [128, 256, 512]
    assert all(r["seconds"] > 0 for r in result["prefill"] + result["decode"])
    assert [r["cached_tokens"] for r in result["behind_cache"]] == [0, 1024]
    assert [(r["batch"], r["graphed"]) for r in result["graphed_decode"]] == [
        (1, False),
        (8, False),
    ]
    assert len(result["host_to_gpu"]) == len(result["file_to_gpu"]) == 3
    # A CPU check never drops the machine's page cache.
    assert result["page_cache_dropped"] is False
    summary = (out / "summary.txt").read_text()
    assert "prefill: alpha" in summary and "local file -> GPU" in summary
    assert "page cache was not dropped" in summary
    # The vLLM venv has no matplotlib: the run says so, and --report draws the plot.
    assert ("no plot" in proc.stdout) != (out / "gpu_timing.png").exists()
    report = subprocess.run(
        [sys.executable, "-m", "bench.gpu_timing", "--report", str(out / "gpu_timing.json")],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    assert (out / "gpu_timing.png").read_bytes()[:4] == b"\x89PNG"
    assert list(tmp_path.glob("tmp*")) == []  # the KV files are cleaned up
