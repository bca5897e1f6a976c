"""Bounded LRU block sets: the building block of a simulated pod's cache tiers.

``LRUTier`` holds L0 (the engine's GPU prefix cache, KV-event medium ``GPU``) and
L1 (host DRAM, medium ``CPU``); ``bench.podmodel.TieredCache`` chains them with
the fleet-wide L2. Keys are any hashable block id: the engine's 32-byte digests
in the live simulator, router keys (ints) in the discrete-event simulator.

Fidelity notes (vLLM 0.32, ``KVCacheManager.get_computed_blocks``):
only full blocks are cached, and when every full block of a prompt is cached the
engine still recomputes the last prompt token to get logits, so the usable hit is
capped at ``(num_prompt_tokens - 1) // block_size`` blocks (see ``max_hit_blocks``).
Freed blocks go back to the free queue tail-first, so of one request's chain the
*last* block is evicted first; ``LRUTier.insert`` reproduces that order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

BlockId = Hashable  # engine digest (live sim) or router key (discrete-event sim)


def max_hit_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most blocks a prompt can take from cache: the last token is always recomputed."""
    return max(num_prompt_tokens - 1, 0) // block_size


@dataclass(slots=True)
class InsertResult:
    """What one insert did to one tier."""

    stored: list[BlockId] = field(default_factory=list)  # newly held, chain order
    evicted: list[BlockId] = field(default_factory=list)  # dropped, eviction order
    held: int = 0  # leading blocks of the inserted chain the tier now holds


class LRUTier:
    """A bounded LRU set of block hashes; O(len(chain)) per call, never O(capacity)."""

    def __init__(self, capacity: int, name: str = "L0", medium: str = "GPU") -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.name = name
        self.medium = medium
        self.capacity = capacity
        # Front = evicted next. Values unused: an ordered set.
        self._blocks: OrderedDict[BlockId, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def lookup(self, hashes: Sequence[BlockId], start: int = 0) -> int:
        """Consecutive blocks held from ``hashes[start]`` on. Does not touch LRU order."""
        held = 0
        for h in hashes[start:]:
            if h not in self._blocks:
                break
            held += 1
        return held

    def put(self, hashes: Sequence[BlockId]) -> InsertResult:
        """Hold ``hashes`` in the given order, the last most recently used.

        For blocks that arrive one by one (L0 evictions offloaded to L1). Only the
        net effect is reported: a block stored and evicted by the same call is in
        neither list, so ``stored`` and ``evicted`` are disjoint.
        """
        blocks = self._blocks
        result = InsertResult()
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                result.stored.append(h)
        fresh = set(result.stored)
        while len(blocks) > self.capacity:
            evicted, _ = blocks.popitem(last=False)
            if evicted in fresh:
                fresh.discard(evicted)
            else:
                result.evicted.append(evicted)
        result.stored = [h for h in result.stored if h in fresh]
        result.held = len(result.stored)
        return result

    def touch(self, hashes: Sequence[BlockId]) -> None:
        """Mark held blocks as just used (a hit); unknown ones are ignored."""
        blocks = self._blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)

    def insert(self, hashes: Sequence[BlockId]) -> InsertResult:
        """Hold the chain ``hashes`` (a prefix from block 0), most recently used.

        Existing blocks are touched, missing ones stored; a chain longer than the
        tier keeps only its leading ``capacity`` blocks. The chain goes in
        reversed so its tail is evicted first, like vLLM's free queue.
        """
        chain = hashes[: self.capacity]
        result = InsertResult(held=len(chain))
        blocks = self._blocks
        for h in reversed(chain):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                result.stored.append(h)
        result.stored.reverse()
        while len(blocks) > self.capacity:
            evicted, _ = blocks.popitem(last=False)
            result.evicted.append(evicted)
        return result

    def clear(self) -> int:
        """Drop everything (vLLM's reset_prefix_cache); returns how many were held."""
        n = len(self._blocks)
        self._blocks.clear()
        return n
