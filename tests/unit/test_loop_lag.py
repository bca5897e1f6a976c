"""The event-loop lag histogram sees a blocked loop, and costs one sample per interval."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from gateway.loop_lag import LoopLagMonitor


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    return {
        s.name + (f"{{le={s.labels['le']}}}" if "le" in s.labels else ""): s.value
        for metric in registry.collect()
        for s in metric.samples
    }


async def test_a_loop_blocked_for_80_ms_is_seen_as_lag_of_at_least_that() -> None:
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, interval_s=0.01)
    monitor.start()
    await asyncio.sleep(0.05)  # a few samples of an idle loop

    time.sleep(0.08)  # CPU work on the loop: nothing else runs meanwhile
    await asyncio.sleep(0.03)
    await monitor.stop()

    samples = _samples(registry)
    count = samples["kvgate_event_loop_lag_seconds_count"]
    at_most_50ms = samples["kvgate_event_loop_lag_seconds_bucket{le=0.05}"]
    assert count >= 2  # one before the block at least (~5 on an idle box), and its victim
    assert count - at_most_50ms >= 1  # the sample the blocked loop delayed
    assert samples["kvgate_event_loop_lag_seconds_sum"] >= 0.07


async def test_the_monitor_samples_once_per_interval_and_stops() -> None:
    registry = CollectorRegistry()
    monitor = LoopLagMonitor(registry, interval_s=0.02)
    monitor.start()
    monitor.start()  # idempotent: still one sampling task

    await asyncio.sleep(0.21)
    await monitor.stop()
    stopped_at = _samples(registry)["kvgate_event_loop_lag_seconds_count"]
    await asyncio.sleep(0.05)

    # ~10 intervals: never more than one sample each; fewer when a busy CI box delays
    # the loop's timers, but more than a couple (it keeps sampling until stopped)
    assert 3 <= stopped_at <= 11
    assert _samples(registry)["kvgate_event_loop_lag_seconds_count"] == stopped_at
