"""Engine block hash → router key(s), per pod (and DP rank), bounded LRU.

Learned from ``BlockStored`` events that carry token ids; used to resolve what carries
only engine hashes: ``BlockRemoved``, tokenless offload ``BlockStored`` (vLLM native
CPU/STORAGE tiers), and the ``parent_block_hash`` of a later ``BlockStored``.

An engine block usually is one router block (value: one int). When the engine's
blocks are a multiple ``k`` of the router's block size (e.g. LMCache 256-token
chunks), one engine hash stands for ``k`` consecutive router keys (value: a tuple);
the last of them is the parent of the next block.

Each entry also keeps where its first router key sits on its chain (depth, group
anchor, parent; see ``kvindex.store.Positions``), so that hash-only events can tell
stores with per-group summaries which groups they touch.
"""

from __future__ import annotations

from typing import NamedTuple

from kvindex.events.types import EngineHash
from kvindex.lru import BoundedLRU
from kvindex.store import Positions, chain_positions

RouterKeys = int | tuple[int, ...]
DEFAULT_CAPACITY = 262_144


class Entry(NamedTuple):
    keys: RouterKeys
    depth: int  # of the first key; the root's first block is 0
    anchor: int  # first key's group anchor
    parent: int  # first key's parent (itself at a group start)

    def key_list(self) -> list[int]:
        return [self.keys] if isinstance(self.keys, int) else list(self.keys)

    def positions(self) -> Positions:
        return chain_positions(self.key_list(), self.depth, self.anchor, self.parent)

    def tail(self) -> tuple[int, int, int]:
        """(last key, its depth, its group anchor): what a child block chains from."""
        if isinstance(self.keys, int):
            return self.keys, self.depth, self.anchor
        pos = self.positions()
        return self.keys[-1], self.depth + len(self.keys) - 1, pos.anchors[-1]


class EngineKeyMap:
    """Bounded LRU map; the least recently learned or used hash is evicted first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._map: BoundedLRU[EngineHash, Entry] = BoundedLRU(capacity)

    @property
    def capacity(self) -> int:
        return self._map.capacity

    @property
    def evictions(self) -> int:
        return self._map.evictions

    def __len__(self) -> int:
        return len(self._map)

    def learn(
        self, engine_hash: EngineHash, keys: RouterKeys, depth: int, anchor: int, parent: int
    ) -> None:
        self._map.put(engine_hash, Entry(keys, depth, anchor, parent))

    def entry(self, engine_hash: EngineHash) -> Entry | None:
        return self._map.touch(engine_hash)

    def get(self, engine_hash: EngineHash) -> RouterKeys | None:
        found = self.entry(engine_hash)
        return None if found is None else found.keys

    def last_key(self, engine_hash: EngineHash) -> int | None:
        """The router key that a child block chains from, or None if unknown."""
        found = self.entry(engine_hash)
        return None if found is None else found.tail()[0]

    def clear(self) -> None:
        self._map.clear()
