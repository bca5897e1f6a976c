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

An entry lives while the pod holds its block in some tier: each ``BlockStored`` sets
the tier's bit, each ``BlockRemoved`` clears it, and the entry goes with the last
bit. Without that the map filled up to its capacity with blocks long evicted (~360 B
an entry: a few hundred MB per pod at the old default), which is how a gateway's
memory grew for hours under a steady load. The capacity remains the bound for the
worst case (an engine whose removals never arrive).
"""

from __future__ import annotations

from kvindex.events.types import EngineHash
from kvindex.lru import BoundedLRU
from kvindex.store import Positions, chain_positions
from kvindex.types import Bound, Tier

RouterKeys = int | tuple[int, ...]
DEFAULT_CAPACITY = 262_144
ENTRY_BYTES = 360  # measured with tracemalloc: entry, its ints, the LRU's node and key


class Entry:
    """Router keys of one engine hash, their chain position, and the tiers holding it."""

    __slots__ = ("keys", "depth", "anchor", "parent", "tiers")

    def __init__(
        self, keys: RouterKeys, depth: int, anchor: int, parent: int, tiers: int = 0
    ) -> None:
        self.keys = keys
        self.depth = depth  # of the first key; the root's first block is 0
        self.anchor = anchor  # first key's group anchor
        self.parent = parent  # first key's parent (itself at a group start)
        self.tiers = tiers  # bit 1 << tier for each tier the pod holds the block in

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
        self,
        engine_hash: EngineHash,
        keys: RouterKeys,
        depth: int,
        anchor: int,
        parent: int,
        tier: Tier = Tier.L0,
    ) -> None:
        """The block was stored in ``tier`` with its tokens: remember its keys."""
        known = self._map.touch(engine_hash)
        tiers = (known.tiers if known is not None else 0) | (1 << tier)
        self._map.put(engine_hash, Entry(keys, depth, anchor, parent, tiers))

    def entry(self, engine_hash: EngineHash) -> Entry | None:
        return self._map.touch(engine_hash)

    def hold(self, engine_hash: EngineHash, tier: Tier) -> Entry | None:
        """A hash-only ``BlockStored``: the known block is now also held in ``tier``."""
        found = self._map.touch(engine_hash)
        if found is not None:
            found.tiers |= 1 << tier
        return found

    def release(self, engine_hash: EngineHash, tier: Tier) -> Entry | None:
        """A ``BlockRemoved`` from ``tier``: the entry (for its keys), dropped from the
        map once no tier holds the block."""
        found = self._map.get(engine_hash)
        if found is not None:
            found.tiers &= ~(1 << tier)
            if not found.tiers:
                self._map.pop(engine_hash)
        return found

    def release_all(self, tiers: tuple[Tier, ...]) -> None:
        """``AllBlocksCleared``: those tiers hold nothing; drop entries left in none."""
        mask = sum(1 << t for t in tiers)
        gone = []
        for engine_hash in self._map:
            found = self._map.get(engine_hash)
            if found is not None:
                found.tiers &= ~mask
                if not found.tiers:
                    gone.append(engine_hash)
        for engine_hash in gone:
            self._map.pop(engine_hash)

    def get(self, engine_hash: EngineHash) -> RouterKeys | None:
        found = self.entry(engine_hash)
        return None if found is None else found.keys

    def last_key(self, engine_hash: EngineHash) -> int | None:
        """The router key that a child block chains from, or None if unknown."""
        found = self.entry(engine_hash)
        return None if found is None else found.tail()[0]

    def clear(self) -> None:
        self._map.clear()

    def bound(self) -> Bound:
        return Bound(len(self._map), self.capacity, "hashes", ENTRY_BYTES)
