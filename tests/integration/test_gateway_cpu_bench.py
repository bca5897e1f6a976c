"""``python -m bench.gateway_cpu``: a gateway's CPU per request in front of simulated pods."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from bench.overhead import process_cpu_s


def test_the_cpu_clock_it_reads_grows_with_this_processs_work():
    before = process_cpu_s(os.getpid())
    end = sum(i * i for i in range(3_000_000))  # ~0.2 s of CPU: at least a few ticks
    assert end > 0 and process_cpu_s(os.getpid()) > before


def test_the_benchmark_reports_the_gateways_cpu_per_request():
    out = subprocess.run(
        [sys.executable, "-m", "bench.gateway_cpu", "--seeds", "1", "--rate", "48",
         "--max-tokens", "2"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    found = re.search(r"96 requests in [\d.]+ s, gateway CPU ([\d.]+) s = ([\d.]+) ms per request",
                      out.stdout)  # fmt: skip
    assert found, out.stdout + out.stderr
    cpu_s, per_request_ms = float(found[1]), float(found[2])
    # both printed to 2 decimals: the per-request figure is the total over 96 requests
    assert cpu_s > 0 and abs(per_request_ms - 1000 * cpu_s / 96) < 0.06


def test_it_refuses_a_router_that_is_not_a_peer():
    out = subprocess.run(
        [sys.executable, "-m", "bench.gateway_cpu", "--router", "nginx"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "--router: one of vllm-router, sglang-router" in out.stderr
