"""``bench.machine_speed``: the machine's CPU speed, sampled beside a benchmark."""

from __future__ import annotations

import statistics
import time

from bench.machine_speed import SpeedSampler, loop_cpu_ms


def test_the_loop_costs_cpu_time_that_grows_with_its_length():
    short, long = loop_cpu_ms(20_000), loop_cpu_ms(200_000)
    assert 0 < short < long


def test_the_sampler_keeps_timed_samples_from_its_own_process_and_a_window_of_them():
    with SpeedSampler(period_s=0.02) as speed:
        started = time.monotonic()
        deadline = started + 10
        while len(speed.samples()) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = time.monotonic()
    window = speed.samples(started, ended)
    assert len(window) >= 5 and all(ms > 0 for ms in window)
    assert speed.median_ms(started, ended) == statistics.median(window)
    assert speed.median_ms(ended + 60, ended + 120) is None  # no samples there
