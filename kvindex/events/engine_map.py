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


# One engine hash's entry: (router keys, the first key's depth, its group anchor, its
# parent, the tiers holding the block as bits 1 << tier). A plain tuple of ints, not an
# object: CPython's collector stops tracking such a tuple after one look, while a map
# of 262k slotted objects made every full collection walk all of them (55-57 ms a
# pod's full map, 19-22 with tuples: the map's own walk; `kvgate bench index`).
Entry = tuple[RouterKeys, int, int, int, int]
_KEYS, _TIERS = 0, 4


def key_list(entry: Entry) -> list[int]:
    keys = entry[_KEYS]
    return [keys] if isinstance(keys, int) else list(keys)


def positions(entry: Entry) -> Positions:
    """Where the entry's router keys sit on their chain."""
    _, depth, anchor, parent, _ = entry
    return chain_positions(key_list(entry), depth, anchor, parent)


def tail(entry: Entry) -> tuple[int, int, int]:
    """(last key, its depth, its group anchor): what a child block chains from."""
    keys, depth, anchor, _, _ = entry
    if isinstance(keys, int):
        return keys, depth, anchor
    return keys[-1], depth + len(keys) - 1, positions(entry).anchors[-1]


def _with_tiers(entry: Entry, tiers: int) -> Entry:
    keys, depth, anchor, parent, _ = entry
    return keys, depth, anchor, parent, tiers


def _weight(entry: Entry) -> int:
    """An entry's router keys: what it holds grows with them, and the pod chooses how
    many (an engine block of ``k`` router blocks is ``k`` keys under one hash)."""
    keys = entry[_KEYS]
    return 1 if isinstance(keys, int) else len(keys)


class EngineKeyMap:
    """Bounded LRU map; the least recently learned or used hash is evicted first.

    ``capacity`` counts router keys, not engine hashes: an event's ``block_size`` is
    the pod's to choose, and one hash of a 64k-token engine block held 4,096 keys
    (~190 KB), so a map bounded by hashes alone was bounded by nothing. A one-key
    entry, the most a key costs (``ENTRY_BYTES``), weighs 1, so the worst case stays
    ``capacity * ENTRY_BYTES``."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._map: BoundedLRU[EngineHash, Entry] = BoundedLRU(capacity, weigh=_weight)

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
        tiers = (known[_TIERS] if known is not None else 0) | (1 << tier)
        self._map.put(engine_hash, (keys, depth, anchor, parent, tiers))

    def entry(self, engine_hash: EngineHash) -> Entry | None:
        return self._map.touch(engine_hash)

    def hold(self, engine_hash: EngineHash, tier: Tier) -> Entry | None:
        """A hash-only ``BlockStored``: the known block is now also held in ``tier``."""
        found = self._map.touch(engine_hash)
        if found is not None and not found[_TIERS] >> tier & 1:
            found = _with_tiers(found, found[_TIERS] | 1 << tier)
            self._map.replace(engine_hash, found)
        return found

    def release(self, engine_hash: EngineHash, tier: Tier) -> Entry | None:
        """A ``BlockRemoved`` from ``tier``: the entry (for its keys), dropped from the
        map once no tier holds the block."""
        found = self._map.get(engine_hash)
        if found is not None:
            tiers = found[_TIERS] & ~(1 << tier)
            if not tiers:
                self._map.pop(engine_hash)
            elif tiers != found[_TIERS]:
                self._map.replace(engine_hash, _with_tiers(found, tiers))
        return found

    def release_all(self, tiers: tuple[Tier, ...]) -> None:
        """``AllBlocksCleared``: those tiers hold nothing; drop entries left in none."""
        mask = sum(1 << t for t in tiers)
        gone = []
        kept: list[tuple[EngineHash, Entry]] = []
        for engine_hash in self._map:
            found = self._map.get(engine_hash)
            if found is not None and found[_TIERS] & mask:
                left = found[_TIERS] & ~mask
                if left:
                    kept.append((engine_hash, _with_tiers(found, left)))
                else:
                    gone.append(engine_hash)
        for engine_hash in gone:
            self._map.pop(engine_hash)
        for engine_hash, entry in kept:
            self._map.replace(engine_hash, entry)

    def get(self, engine_hash: EngineHash) -> RouterKeys | None:
        found = self.entry(engine_hash)
        return None if found is None else found[_KEYS]

    def last_key(self, engine_hash: EngineHash) -> int | None:
        """The router key that a child block chains from, or None if unknown."""
        found = self.entry(engine_hash)
        return None if found is None else tail(found)[0]

    def clear(self) -> None:
        self._map.clear()

    def bound(self) -> Bound:
        return Bound(self._map.size, self.capacity, "keys", ENTRY_BYTES)
