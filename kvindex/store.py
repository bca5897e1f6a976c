"""The ``IndexStore`` protocol and the events it applies (in router-key space).

Decoders (``kvindex.events``) turn vLLM's wire events into ``IndexOp``s whose keys
are already the router's own block keys; stores only ever see router keys.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvindex.types import PrefixMatch, Tier

GROUP_BLOCKS = 16  # blocks per chain group (``Positions.offsets`` are depth mod this)


@dataclass(frozen=True, slots=True)
class Positions:
    """Where each key of an op sits on its chain, aligned with the op's keys.

    Chains are cut into groups of ``GROUP_BLOCKS`` blocks from the root: block ``d``
    is at ``offset = d % GROUP_BLOCKS`` of the group whose first block (its
    ``anchor``) is at depth ``d - offset``; ``parent`` is the block before it (its
    own key at offset 0, where the parent lies in the previous group and is not
    needed). Stores that keep per-group summaries (``RedisStore``) use them; the
    others ignore them. Ops without positions stay exact, only slower to look up
    in such stores."""

    offsets: Sequence[int]
    anchors: Sequence[int]
    parents: Sequence[int]

    def __len__(self) -> int:
        return len(self.offsets)

    def slice(self, start: int, end: int | None = None) -> Positions:
        """The positions of ``keys[start:end]``."""
        return Positions(self.offsets[start:end], self.anchors[start:end], self.parents[start:end])


def chain_positions(
    keys: Sequence[int], depth: int = 0, anchor: int = 0, parent: int = 0
) -> Positions:
    """Positions of ``keys`` as one chain whose first key is at ``depth``.

    ``anchor``/``parent``: the first key's group anchor and parent when ``depth`` is
    not a multiple of ``GROUP_BLOCKS`` (ignored otherwise)."""
    offsets, anchors, parents = [], [], []
    for i, key in enumerate(keys):
        off = (depth + i) % GROUP_BLOCKS
        if off == 0:
            anchor = key
        if i:
            parent = keys[i - 1]
        offsets.append(off)
        anchors.append(anchor)
        parents.append(parent if off else key)
    return Positions(offsets, anchors, parents)


@dataclass(frozen=True, slots=True)
class Stored:
    tier: Tier
    keys: Sequence[int]
    pos: Positions | None = field(default=None, compare=False)  # aligned with keys; None: unknown


@dataclass(frozen=True, slots=True)
class Removed:
    tier: Tier
    keys: Sequence[int]
    pos: Positions | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Cleared:
    """Drop everything a pod holds in these tiers (AllBlocksCleared, restart)."""

    tiers: tuple[Tier, ...] = (Tier.L0, Tier.L1)


IndexOp = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class IndexStats:
    backend: str
    keys: int  # distinct block keys held (any tier)
    capacity: int
    per_pod: dict[str, dict[str, int]] = field(default_factory=dict)  # pod -> tier name -> n
    l2_keys: int = 0


@runtime_checkable
class IndexStore(Protocol):
    """What is cached where. L0/L1 entries belong to a pod; L2 is fleet-wide."""

    async def apply(self, pod: str, ops: Sequence[IndexOp]) -> None: ...

    async def match(self, keys: Sequence[int], block_size: int) -> PrefixMatch: ...

    async def speculate(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        """Count ``keys`` as held in L0 by ``pod`` for ``ttl_s`` unless events confirm
        them first: the router's own dispatch, visible before the engine reports it."""
        ...

    def speculate_nowait(
        self, pod: str, keys: Sequence[int], ttl_s: float
    ) -> Coroutine[Any, Any, None] | None:
        """``speculate`` without waiting: what can be recorded synchronously is (an
        in-process view), before the caller's next request is routed; a network write
        that remains comes back as a coroutine for the caller to run in the background."""
        ...

    async def l2_writers(self, keys: Sequence[int]) -> dict[str, int]:
        """Per pod, how many of the consecutive L2 prefix blocks it wrote (cross-pod hits)."""
        ...

    async def drop_pod(self, pod: str) -> None: ...

    def l0_blocks_now(self, pod: str) -> int | None:
        """How many blocks ``pod`` holds in L0 by its events since this index began
        following them (0 if none arrived), from an in-process view; None where no
        such view is exact (the store keeps none, or has dropped keys for its own
        capacity). Read on every routing, so it must not wait."""
        ...

    async def stats(self) -> IndexStats: ...

    async def close(self) -> None: ...
