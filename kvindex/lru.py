"""A bounded least-recently-used map: every cache and map in kvindex and routing has a
capacity.

Routing strategies remember things per request (prefix hash -> pods, session -> pod),
the event pipeline maps engine hashes to router keys, tokenization caches token ids,
the keyer caches chain roots: with a million distinct prompts an unbounded dict is a
slow memory leak. ``BoundedLRU`` evicts the least recently *written or touched* entry
once the entries' total weight passes ``capacity``. An entry weighs 1 unless the map
is given ``weigh`` (the token cache weighs a prompt by its token count), so capacity
counts entries or units. It is a thin wrapper over ``OrderedDict`` (C-implemented
``move_to_end`` and ``popitem``), so one operation is well under a microsecond.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """Map with a hard limit on its total weight; ``evictions`` counts what fell out.

    ``get`` reads without changing recency (a lookup must not keep dead entries
    alive); ``touch`` reads and refreshes. Values are never None: None means absent.
    """

    __slots__ = ("_data", "_weigh", "_weight", "capacity", "evictions", "get")

    def __init__(self, capacity: int, weigh: Callable[[V], int] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.evictions = 0
        self._weigh = weigh
        self._weight = 0  # total weight held, when weighted
        self._data: OrderedDict[K, V] = OrderedDict()
        # Bound straight to the C method: it is the hot path of every routing decision.
        self.get: Callable[[K], V | None] = self._data.get

    @property
    def size(self) -> int:
        """Total weight held: the number of entries, when unweighted."""
        return len(self._data) if self._weigh is None else self._weight

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def touch(self, key: K) -> V | None:
        """``key``'s value, now the most recently used; None if absent."""
        data = self._data
        try:
            data.move_to_end(key)
        except KeyError:
            return None
        return data[key]

    def put(self, key: K, value: V) -> None:
        """Insert or replace ``key`` as most recently used; evict the oldest until the
        total weight fits. A value heavier than ``capacity`` is not kept (nor is what
        ``key`` held before)."""
        data = self._data
        weigh = self._weigh
        if weigh is None:  # every entry weighs 1: the fast path routing takes per chunk
            if key in data:
                data.move_to_end(key)
                data[key] = value
                return
            data[key] = value
            if len(data) > self.capacity:
                data.popitem(last=False)
                self.evictions += 1
            return
        old = data.pop(key, None)
        if old is not None:
            self._weight -= weigh(old)
        weight = weigh(value)
        if weight > self.capacity:
            return
        data[key] = value
        self._weight += weight
        while self._weight > self.capacity:
            _, oldest = data.popitem(last=False)
            self._weight -= weigh(oldest)
            self.evictions += 1

    def replace(self, key: K, value: V) -> None:
        """Give a present ``key`` a new value and keep its recency (``put`` would make it
        the most recent); an absent key stays absent. A heavier value evicts the oldest
        entries until the total weight fits again, as ``put`` does."""
        data = self._data
        if key not in data:
            return
        if self._weigh is not None:
            self._weight += self._weigh(value) - self._weigh(data[key])
        data[key] = value  # an OrderedDict keeps a present key's place
        while self._weigh is not None and self._weight > self.capacity:
            _, oldest = data.popitem(last=False)
            self._weight -= self._weigh(oldest)
            self.evictions += 1

    def pop(self, key: K) -> V | None:
        value = self._data.pop(key, None)
        if value is not None and self._weigh is not None:
            self._weight -= self._weigh(value)
        return value

    def clear(self) -> None:
        self._data.clear()
        self._weight = 0
