"""A test fake ``IndexStore`` that only records what it is asked to apply.

Event tests compare its ops with the exact expected ones. Bounded: it keeps the last
``capacity`` calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvindex.store import IndexOp, IndexStats
from kvindex.types import PrefixMatch


class RecordingStore:
    def __init__(self, capacity: int = 100_000) -> None:
        self.calls: deque[tuple[str, list[IndexOp]]] = deque(maxlen=capacity)
        self.dropped: list[str] = []

    def ops(self, pod: str | None = None) -> list[IndexOp]:
        """All recorded ops (of one pod), flattened in the order applied."""
        return [op for p, ops in self.calls if pod is None or p == pod for op in ops]

    async def apply(self, pod: str, ops: Sequence[IndexOp]) -> None:
        self.calls.append((pod, list(ops)))

    async def match(self, keys: Sequence[int], block_size: int) -> PrefixMatch:
        return PrefixMatch.empty(total_blocks=len(keys), block_size=block_size)

    async def speculate(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        return None  # a recorder learns only from events

    async def l2_writers(self, keys: Sequence[int]) -> dict[str, int]:
        return {}

    async def drop_pod(self, pod: str) -> None:
        self.dropped.append(pod)

    async def stats(self) -> IndexStats:
        return IndexStats(backend="recording", keys=0, capacity=0)

    async def close(self) -> None:
        return None
