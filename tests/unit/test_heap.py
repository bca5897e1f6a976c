"""``gateway.heap.settle``: collect, then freeze the survivors out of the collector's walk."""

import asyncio
import gc
import multiprocessing
import weakref

from prometheus_client import CollectorRegistry, Counter

from gateway import heap
from gateway.server import use_multiprocess_metrics


class Node:
    """A container in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_settle_collects_cyclic_garbage_and_freezes_what_is_alive():
    dropped, kept = Node(), Node()
    dropped_ref = weakref.ref(dropped)
    del dropped

    frozen = heap.settle()

    assert dropped_ref() is None
    assert frozen == gc.get_freeze_count() > 0
    assert all(o is not kept for o in gc.get_objects())  # out of every generation


def test_a_frozen_cycle_dropped_later_is_collected_by_the_next_settle():
    node = Node()
    ref = weakref.ref(node)
    heap.settle()
    del node

    gc.collect()  # a full collection does not walk frozen objects
    assert ref() is not None

    heap.settle()
    assert ref() is None


def test_settle_makes_young_collections_rare():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's default
    try:
        heap.settle()
        assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, 10, 10)
        assert heap.YOUNG_THRESHOLD > 700
    finally:
        gc.set_threshold(*before)


def test_every_collection_is_timed_by_generation_until_stopped():
    registry = CollectorRegistry()
    pauses = heap.GcPauses(registry)
    gc.disable()  # only the collections this test asks for
    try:
        pauses.start()
        pauses.start()  # once, however often started
        gc.collect(0)
        gc.collect()
        pauses.flush()
        counts = {g: registry.get_sample_value("kvgate_gc_pause_seconds_count",
                                               {"generation": g}) for g in "012"}  # fmt: skip
        assert counts == {"0": 1.0, "1": 0.0, "2": 1.0}
        assert registry.get_sample_value("kvgate_gc_pause_seconds_sum", {"generation": "2"}) > 0

        asyncio.run(pauses.stop())
        gc.collect()
        pauses.flush()
        assert (
            registry.get_sample_value("kvgate_gc_pause_seconds_count", {"generation": "2"}) == 1.0
        )
    finally:
        asyncio.run(pauses.stop())
        gc.enable()


def _collect_while_metrics_are_locked(directory: str) -> None:
    """A collection inside prometheus_client's multiprocess lock: a new series is
    created under that (non-reentrant) lock and allocates, and with a threshold of 1
    every allocation of a container collects."""
    use_multiprocess_metrics(directory)
    registry = CollectorRegistry()
    pauses = heap.GcPauses(registry)
    pauses.start()
    counter = Counter("kvgate_gc_test", "x", ["n"], registry=registry)
    gc.set_threshold(1)
    for n in range(50):
        counter.labels(str(n)).inc()
    gc.set_threshold(700)
    pauses.flush()


def test_a_collection_inside_a_metrics_update_does_not_wait_on_the_metrics_lock(tmp_path):
    """``--workers`` gateways hung for good when a collection started while
    prometheus_client held its multiprocess lock and the pause was observed at once;
    pauses wait in a buffer until ``flush``."""
    child = multiprocessing.get_context("fork").Process(
        target=_collect_while_metrics_are_locked, args=(str(tmp_path),)
    )
    child.start()
    child.join(20)
    hung = child.exitcode is None
    if hung:
        child.kill()
    assert not hung and child.exitcode == 0


async def test_pauses_reach_the_histogram_from_the_event_loop(monkeypatch):
    monkeypatch.setattr(heap, "FLUSH_EVERY_S", 0.01)
    registry = CollectorRegistry()
    pauses = heap.GcPauses(registry)
    pauses.start()
    try:
        gc.collect()
        assert registry.get_sample_value(
            "kvgate_gc_pause_seconds_count", {"generation": "2"}) == 0.0  # fmt: skip
        await asyncio.sleep(0.1)
        assert registry.get_sample_value(
            "kvgate_gc_pause_seconds_count", {"generation": "2"}) >= 1.0  # fmt: skip
    finally:
        await pauses.stop()
