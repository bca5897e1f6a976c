"""Types shared by the index and its readers (routing, gateway, bench).

Everything is counted in *blocks* of the model's block size; callers convert to
tokens with ``PrefixMatch.block_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum


class Tier(IntEnum):
    """Where a block lives. L0/L1 belong to one pod; L2 is shared by the fleet."""

    L0 = 0  # engine medium "GPU": the prefix cache in accelerator memory
    L1 = 1  # engine medium "CPU"/"cpu": host DRAM offload (vLLM native or LMCache)
    L2 = 2  # engine medium "STORAGE" with locality REMOTE: a filesystem every pod reads


@dataclass(frozen=True, slots=True)
class PodPrefix:
    """Consecutive prefix (in blocks) one pod holds, counted from the first block."""

    l0: int = 0
    l0_l1: int = 0  # consecutive blocks held in L0 or L1 (>= l0)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Answer of ``IndexStore.match(keys)``."""

    total_blocks: int
    block_size: int
    pods: Mapping[str, PodPrefix] = field(default_factory=dict)
    l2: int = 0  # fleet-wide consecutive prefix held in L2

    @classmethod
    def empty(cls, total_blocks: int = 0, block_size: int = 16) -> PrefixMatch:
        return cls(total_blocks=total_blocks, block_size=block_size)

    def for_pod(self, pod: str) -> PodPrefix:
        return self.pods.get(pod, _NOTHING)


_NOTHING = PodPrefix()


@dataclass(frozen=True, slots=True)
class Bound:
    """How full one bounded structure is, and what a unit of it costs in memory.

    ``bytes_each`` is measured (tracemalloc, on CPython 3.11), so ``capacity *
    bytes_each`` is the structure's worst case; ``/admin/bounds`` reports both."""

    size: int
    capacity: int
    unit: str  # what size and capacity count: keys, entries, tokens ...
    bytes_each: int

    @property
    def worst_case_bytes(self) -> int:
        return self.capacity * self.bytes_each
