"""Engine block hash → router key(s), per pod (and DP rank), bounded LRU.

Learned from ``BlockStored`` events that carry token ids; used to resolve what carries
only engine hashes: ``BlockRemoved``, tokenless offload ``BlockStored`` (vLLM native
CPU/STORAGE tiers), and the ``parent_block_hash`` of a later ``BlockStored``.

An engine block usually is one router block (value: one int). When the engine's
blocks are a multiple ``k`` of the router's block size (e.g. LMCache 256-token
chunks), one engine hash stands for ``k`` consecutive router keys (value: a tuple);
the last of them is the parent of the next block.
"""

from __future__ import annotations

from collections import OrderedDict

from kvindex.events.types import EngineHash

RouterKeys = int | tuple[int, ...]
DEFAULT_CAPACITY = 262_144


class EngineKeyMap:
    """Bounded LRU map; the least recently learned or used hash is evicted first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._map: OrderedDict[EngineHash, RouterKeys] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._map)

    def learn(self, engine_hash: EngineHash, keys: RouterKeys) -> None:
        m = self._map
        m[engine_hash] = keys
        m.move_to_end(engine_hash)
        if len(m) > self.capacity:
            m.popitem(last=False)
            self.evictions += 1

    def get(self, engine_hash: EngineHash) -> RouterKeys | None:
        keys = self._map.get(engine_hash)
        if keys is not None:
            self._map.move_to_end(engine_hash)
        return keys

    def last_key(self, engine_hash: EngineHash) -> int | None:
        """The router key that a child block chains from, or None if unknown."""
        keys = self.get(engine_hash)
        if keys is None or isinstance(keys, int):
            return keys
        return keys[-1]

    def clear(self) -> None:
        self._map.clear()
