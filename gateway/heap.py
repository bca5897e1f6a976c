"""Keeping the cyclic garbage collector off the gateway's long-lived objects.

CPython's collector periodically walks every container it tracks. A gateway's heap
is mostly objects built at start-up and kept for its life (modules, tokenizers and
their templates, the index's tables), and the requests in flight keep promoting a few
thousand objects a second into the oldest generation, so a full collection ran about
once a second under load and each walked all of that heap: 80-110 ms a time, about 8%
of the process's CPU and a pause in every request in flight (``kvgate bench overhead``,
kv-aware, multi-turn; measured with ``gc.callbacks``). ``settle`` collects once and
then freezes what is alive (``gc.freeze``), so later collections walk only what was
made since: a full one took 4-5 ms in the same run. What is made since must not hold
large sets: the index's per-pod key sets, made as pods' events arrive, grew with the
index under load and made full collections 74-81 ms on average again, up to 250 ms
(``bench/gc_pauses.sh varied 30``), until they became dicts of ints, which the
collector does not track (``kvindex.memory_store``). Young collections run far less
often than CPython's default (``YOUNG_THRESHOLD``).

Frozen objects are never collected, so cyclic garbage among them would stay: the
gateway settles after start-up and again after a reload (which replaces tokenizers
and strategies), each time unfreezing first so that what the reload dropped is
collected. ``GcPauses`` exports every collection's pause as a histogram.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections import deque

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger("kvgate.heap")


# Net new container objects between young collections (CPython's default: 700). A
# request's objects die by reference count, so at 700 a loaded gateway collected its
# young generation ~80-100 times a second, each walking the requests in flight:
# 3.2-3.6% of its CPU with the middle generation's collections. At 5,000 it collected
# ~once a second, 0.1-0.3% of its CPU, pausing 1.6-2.2 ms each (0.25-0.37 at 700); at
# 2,000 it spent 1.3%, at 10,000 0.2% in 4.3 ms pauses (``bench/gc_pauses.sh``,
# kv-aware, 20 s under wrk, this constant edited in turn; docs/performance.md).
# Cyclic garbage waits longer: at most ~5,000 objects of it.
YOUNG_THRESHOLD = 5_000


def settle() -> int:
    """Collect everything, then freeze the survivors; returns how many are frozen.
    Also sets the young generation's threshold (``YOUNG_THRESHOLD``)."""
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    frozen = gc.get_freeze_count()
    log.debug("heap settled: %d objects frozen in %.0f ms", frozen,
              1000 * (time.perf_counter() - started))  # fmt: skip
    return frozen


# A young collection takes well under a millisecond; a full one of an unfrozen
# gateway heap took ~100 ms.
PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
FLUSH_EVERY_S = 1.0
MAX_BUFFERED_PAUSES = 4096  # young collections run hundreds of times a second under load


class GcPauses:
    """``kvgate_gc_pause_seconds{generation}``: how long each cyclic collection held
    the process (and so every request in flight), timed by ``gc.callbacks``.

    The callback only appends to a buffer; the histogram is updated from the event
    loop every ``FLUSH_EVERY_S``. A collection starts at any allocation, also while
    prometheus_client holds the non-reentrant lock of its multiprocess values (``--workers``):
    creating a series allocates under it, and observing there waited on that lock
    for ever (a worker hung for good)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        histogram = Histogram(
            "kvgate_gc_pause_seconds",
            "How long each cyclic garbage collection held the process, by generation.",
            ["generation"],
            buckets=PAUSE_BUCKETS,
            registry=registry,
        )
        self._by_generation = [histogram.labels(str(g)) for g in range(3)]
        self._started = 0.0
        # (generation, seconds) not yet observed; bounded: what overflows is dropped
        self._paused: deque[tuple[int, float]] = deque(maxlen=MAX_BUFFERED_PAUSES)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Time collections from now on; flush every ``FLUSH_EVERY_S`` when called
        from an event loop (else only ``flush`` observes them)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        with contextlib.suppress(RuntimeError):  # no running loop
            if self._task is None:
                self._task = asyncio.get_running_loop().create_task(self._flush_forever())

    async def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.flush()

    def flush(self) -> None:
        """Observe the buffered pauses (never from inside a collection)."""
        while self._paused:
            generation, seconds = self._paused.popleft()
            self._by_generation[generation].observe(seconds)

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY_S)
            self.flush()

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif 0 <= (generation := info.get("generation", -1)) <= 2:
            self._paused.append((generation, time.perf_counter() - self._started))
