"""Speculations that wait, as a store decorator: ``DeferredSpeculations(store)``.

The router speculates a prompt when it dispatches it. An in-process index need not
be written then, on the request's way to its pod (a new 8 KB prompt is ~125 keys, a
cache miss each): nothing reads the index before the next lookup. So ``defer`` only
notes the speculation, and every entry point of the store writes what was noted
first, in dispatch order: a lookup sees every prompt dispatched before it, an event
batch lands after the speculations it may confirm or remove (a ``Removed`` applied
first would be undone by the speculation written after it, for its TTL), a dropped
pod takes its noted prompts with it. ``flush`` writes them at any other moment (the
gateway: once a response has started). A speculation's TTL counts from its write.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from kvindex.store import IndexOp, IndexStats, IndexStore
from kvindex.types import Bound, PrefixMatch

# An entry is a (pod, keys, ttl) tuple and a list slot; the key list is the dispatching
# request's own, held at most until the next write or lookup.
ENTRY_BYTES = 72


class DeferredSpeculations:
    """Wraps an in-process ``IndexStore`` whose ``speculate_nowait`` leaves nothing to
    run in the background (the memory index); at most ``capacity`` noted prompts, a
    further one writes them all first."""

    def __init__(self, inner: IndexStore, capacity: int) -> None:
        if getattr(inner, "backend", None) != "memory":
            raise ValueError("only an in-process (memory) index can defer its speculations")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.inner = inner
        self.capacity = capacity
        self._noted: list[tuple[str, Sequence[int], float]] = []

    @property
    def backend(self) -> str:
        return "memory"

    def defer(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        """``speculate`` at the store's next use, or at ``flush``."""
        if len(self._noted) >= self.capacity:
            self.flush()
        self._noted.append((pod, keys, ttl_s))

    def flush(self) -> None:
        """Write the noted speculations, in the order they were made."""
        if not self._noted:
            return
        noted, self._noted = self._noted, []
        for pod, keys, ttl_s in noted:
            self.inner.speculate_nowait(pod, keys, ttl_s)

    # -- the store, each entry point after the noted speculations --

    async def apply(self, pod: str, ops: Sequence[IndexOp]) -> None:
        self.flush()
        await self.inner.apply(pod, ops)

    async def match(self, keys: Sequence[int], block_size: int) -> PrefixMatch:
        self.flush()
        return await self.inner.match(keys, block_size)

    async def speculate(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        self.flush()
        await self.inner.speculate(pod, keys, ttl_s)

    def speculate_nowait(
        self, pod: str, keys: Sequence[int], ttl_s: float
    ) -> Coroutine[Any, Any, None] | None:
        self.flush()
        return self.inner.speculate_nowait(pod, keys, ttl_s)

    async def l2_writers(self, keys: Sequence[int]) -> dict[str, int]:
        self.flush()
        return await self.inner.l2_writers(keys)

    async def drop_pod(self, pod: str) -> None:
        self.flush()
        await self.inner.drop_pod(pod)

    def l0_blocks_now(self, pod: str) -> int | None:
        self.flush()
        return self.inner.l0_blocks_now(pod)

    async def stats(self) -> IndexStats:
        self.flush()
        return await self.inner.stats()

    def bounds(self) -> dict[str, Bound]:
        inner: Any = self.inner
        out: dict[str, Bound] = dict(inner.bounds()) if hasattr(inner, "bounds") else {}
        out["speculations_deferred"] = Bound(len(self._noted), self.capacity, "prompts",
                                             ENTRY_BYTES)  # fmt: skip
        return out

    async def close(self) -> None:
        self._noted.clear()
        await self.inner.close()
