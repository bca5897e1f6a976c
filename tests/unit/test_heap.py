"""``gateway.heap.settle``: collect, then freeze the survivors out of the collector's walk."""

import gc
import weakref

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
