"""``kvgate bench overhead`` runs end to end (briefly) and its zero-latency backend
answers like vLLM does: JSON, or SSE ending with usage and [DONE]."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console

from bench.overhead import Bodies, run_overhead, zero_pod


def test_the_zero_pod_answers_json_and_sse_with_usage():
    with zero_pod() as pod:
        body = {"model": "m", "messages": [{"role": "user", "content": "x" * 400}]}
        r = httpx.post(f"{pod}/v1/chat/completions", json=body)
        assert r.json()["usage"]["prompt_tokens"] > 100
        s = httpx.post(f"{pod}/v1/chat/completions", json={**body, "stream": True})
        events = [e for e in s.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert "usage" in json.loads(events[-2][len("data: ") :])
        assert httpx.get(f"{pod}/v1/models").json()["data"][0]["id"] == "kvgate-tiny-llama"


def test_bodies_vary_and_multi_turn_bodies_extend_earlier_ones():
    b = Bodies(2048)
    first, second = json.loads(b.varied()), json.loads(b.varied())
    assert first["messages"][0]["content"] != second["messages"][0]["content"]
    turns = [json.loads(b.multi_turn(live=1)) for _ in range(3)]
    assert turns[1]["messages"][: len(turns[0]["messages"])] == turns[0]["messages"]
    assert len(turns[2]["messages"]) == len(turns[1]["messages"]) + 2


def test_a_short_overhead_run_measures_every_column(tmp_path):
    report = run_overhead(["kvgate:round-robin"], tmp_path, pairs=10, seconds=1,
                          connections=4, console=Console(quiet=True))  # fmt: skip
    (result,) = report.results
    assert result.errors == 0 and not result.note
    for value in (result.added_p50_ms, result.added_p99_ms, result.stream_ttft_added_ms):
        assert math.isfinite(value)
    assert result.rps > 0 and report.direct_rps > 0
    assert (tmp_path / "report.md").exists() and (tmp_path / "overhead.png").exists()


def test_several_runs_give_fresh_prompts_and_a_summary_of_medians_and_worsts(tmp_path):
    report = run_overhead(["kvgate:round-robin"], tmp_path, pairs=6, seconds=1, connections=4,
                          console=Console(quiet=True), runs=2)  # fmt: skip
    assert [r.run for r in report.results] == [0, 1]
    assert all(r.errors == 0 and not r.note and r.rps > 0 for r in report.results)
    text = (tmp_path / "report.md").read_text()
    assert "## Over 2 runs: median (worst)" in text
    assert "| round-robin: added p50 <= 0.5 ms |" in text and " of 2 |" in text


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_benchmark_stopped_by_sigterm_stops_what_it_started(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "bench", "overhead", "--strategy", "round-robin",
         "--seconds", "30", "--pairs", "100000", "--out", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 2:  # the backend and the gateway
            assert proc.poll() is None and time.monotonic() < deadline, "did not start both"
            time.sleep(0.2)
        children = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        deadline = time.monotonic() + 15
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, children)), "a child outlived the benchmark"
    finally:
        if proc.poll() is None:
            proc.kill()
