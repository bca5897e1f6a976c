"""``gateway.heap.settle``: collect, then freeze the survivors out of the collector's walk."""

import gc
import weakref

from prometheus_client import CollectorRegistry

from gateway import heap


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


def test_every_collection_is_timed_by_generation_until_stopped():
    registry = CollectorRegistry()
    pauses = heap.GcPauses(registry)
    gc.disable()  # only the collections this test asks for
    try:
        pauses.start()
        pauses.start()  # once, however often started
        gc.collect(0)
        gc.collect()
        counts = {g: registry.get_sample_value("kvgate_gc_pause_seconds_count",
                                               {"generation": g}) for g in "012"}  # fmt: skip
        assert counts == {"0": 1.0, "1": 0.0, "2": 1.0}
        assert registry.get_sample_value("kvgate_gc_pause_seconds_sum", {"generation": "2"}) > 0

        pauses.stop()
        gc.collect()
        assert (
            registry.get_sample_value("kvgate_gc_pause_seconds_count", {"generation": "2"}) == 1.0
        )
    finally:
        pauses.stop()
        gc.enable()
