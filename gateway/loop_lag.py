"""Event-loop lag: how late the gateway's event loop runs a timer it set, as a histogram.

Every request, event feed and health probe of a gateway process shares one event
loop, so CPU work done on it (a long prompt encoded inline, a large index walk, a
huge body parsed) delays all of them by as much. A task sleeps ``interval_s``
(100 ms) at a time and records how much later than asked it woke up:
``kvgate_event_loop_lag_seconds``. Cost: one timer and one histogram observation
per interval, whatever the traffic.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import CollectorRegistry, Histogram

DEFAULT_INTERVAL_S = 0.1
# From well under a millisecond (a healthy loop) to seconds (a stalled one).
LAG_BUCKETS = (
    0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip


class LoopLagMonitor:
    """Samples the running loop's lag until stopped."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.histogram = Histogram(
            "kvgate_event_loop_lag_seconds",
            "How late the event loop woke a task from a sleep of interval_s (100 ms).",
            buckets=LAG_BUCKETS,
            registry=registry,
        )
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._sample())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _sample(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.histogram.observe(max(0.0, loop.time() - due))
