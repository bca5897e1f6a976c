"""Keeping the cyclic garbage collector off the gateway's long-lived objects.

CPython's collector periodically walks every container it tracks. A gateway's heap
is mostly objects built at start-up and kept for its life (modules, tokenizers and
their templates, the index's tables), and the requests in flight keep promoting a few
thousand objects a second into the oldest generation, so a full collection ran about
once a second under load and each walked all of that heap: 80-110 ms a time, about 8%
of the process's CPU and a pause in every request in flight (``kvgate bench overhead``,
kv-aware, multi-turn; measured with ``gc.callbacks``). ``settle`` collects once and
then freezes what is alive (``gc.freeze``), so later collections walk only what was
made since: a full one took 4-5 ms in the same run.

Frozen objects are never collected, so cyclic garbage among them would stay: the
gateway settles after start-up and again after a reload (which replaces tokenizers
and strategies), each time unfreezing first so that what the reload dropped is
collected. ``GcPauses`` exports every collection's pause as a histogram.
"""

from __future__ import annotations

import gc
import logging
import time

from prometheus_client import CollectorRegistry, Histogram

log = logging.getLogger("kvgate.heap")


def settle() -> int:
    """Collect everything, then freeze the survivors; returns how many are frozen."""
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("heap settled: %d objects frozen in %.0f ms", frozen,
              1000 * (time.perf_counter() - started))  # fmt: skip
    return frozen


# A young collection takes well under a millisecond; a full one of an unfrozen
# gateway heap took ~100 ms.
PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class GcPauses:
    """``kvgate_gc_pause_seconds{generation}``: how long each cyclic collection held
    the process (and so every request in flight), timed by ``gc.callbacks``."""

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

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif 0 <= info.get("generation", -1) <= 2:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._started)
