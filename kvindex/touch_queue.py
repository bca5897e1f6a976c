"""Lookups' LRU touches, queued until the order is next needed, with the same result.

``MemoryStore`` keeps its keys in an ``OrderedDict`` in least-recently-used order:
writes touch their keys and a lookup touches every key it walks. Only writes evict,
and only a snapshot reads the order, so a lookup's touches can wait until just
before the next of those (``apply``) and the order is then exactly what touching at
once would have made: replaying touch sequences in order gives each key the place
of its last touch. Waiting saves work twice over:

* a walk repeated before the next write is queued once (its earlier occurrence
  is dropped: every key of it is touched again later);
* the router records speculation for the prompt it just looked up, a write that
  touches the same keys first, in the same order: when the last queued walk is a
  prefix of the keys the write touches next, it need not be replayed at all. (A
  key of that walk a later lookup dropped is added back by the write into the
  room its drop made, so nothing is evicted before the walk's keys are all at
  the end, in order, either way.)

Bounded: beyond ``capacity`` queued keys, the queue is applied at once.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

DEFAULT_CAPACITY = 1 << 16  # queued keys (~0.5 MB of references)


class TouchQueue:
    """Touches waiting to be applied to one ``OrderedDict``'s order."""

    __slots__ = ("_entries", "_queued", "capacity", "keys")

    def __init__(self, entries: OrderedDict[int, Any], capacity: int = DEFAULT_CAPACITY) -> None:
        self._entries = entries
        self._queued: OrderedDict[tuple[int, ...], None] = OrderedDict()  # oldest first
        self.capacity = capacity
        self.keys = 0  # queued, in all walks

    def defer(self, walked: tuple[int, ...]) -> None:
        """Queue the touch of ``walked`` (present keys, in the order walked)."""
        queued = self._queued
        if queued.pop(walked, 0) is None:  # walked again: only its last touch counts
            self.keys -= len(walked)
        queued[walked] = None
        self.keys += len(walked)
        if self.keys > self.capacity:
            self.apply()

    def apply(self, then: Sequence[int] | None = None) -> tuple[int, ...] | None:
        """Touch the queued walks, oldest first. ``then``: the keys the caller
        touches or adds next, in order (see the module docstring); the last walk,
        if it is their prefix and so left to the caller, is returned."""
        queued = self._queued
        if not queued:
            return None
        left: tuple[int, ...] | None = None
        if then is not None:
            last = next(reversed(queued))
            if len(last) <= len(then) and tuple(then[: len(last)]) == last:
                queued.popitem()
                left = last
        entries = self._entries
        for walked in queued:
            try:
                deque(map(entries.move_to_end, walked), maxlen=0)
            except KeyError:  # a later lookup dropped one of its keys: skip that one
                deque(map(entries.move_to_end, filter(entries.__contains__, walked)), maxlen=0)
        queued.clear()
        self.keys = 0
        return left
