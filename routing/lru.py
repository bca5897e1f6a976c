"""A bounded least-recently-used map: every routing memory has a capacity.

Strategies remember things per request (prefix hash -> pods, session -> pod); with
a million distinct prompts an unbounded dict is a slow memory leak. ``BoundedLRU``
evicts the least recently *written or touched* entry once ``capacity`` is reached.
It is a thin wrapper over ``OrderedDict`` (C-implemented ``move_to_end`` and
``popitem``), so one operation is well under a microsecond.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """Map with a hard size limit; ``evictions`` counts what fell out."""

    __slots__ = ("_data", "capacity", "evictions", "get")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.evictions = 0
        self._data: OrderedDict[K, V] = OrderedDict()
        # Read without changing recency (lookups must not keep dead entries alive).
        # Bound straight to the C method: it is the hot path of every routing decision.
        self.get: Callable[[K], V | None] = self._data.get

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def touch(self, key: K) -> None:
        """Mark ``key`` most recently used, if present."""
        if key in self._data:
            self._data.move_to_end(key)

    def put(self, key: K, value: V) -> None:
        """Insert or replace ``key`` as most recently used; evict the oldest if full."""
        data = self._data
        if key in data:
            data.move_to_end(key)
            data[key] = value
            return
        data[key] = value
        if len(data) > self.capacity:
            data.popitem(last=False)
            self.evictions += 1

    def pop(self, key: K) -> V | None:
        return self._data.pop(key, None)

    def clear(self) -> None:
        self._data.clear()
