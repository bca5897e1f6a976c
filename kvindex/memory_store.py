"""In-process ``IndexStore``: a bounded LRU map from router block key to holders.

Why this shape: the gateway does one ``match`` per request over up to a few
thousand keys and applies ~100k block events per second, all in pure Python on
the event loop. So every per-key step must be a couple of C-level dict/int ops:

* each pod gets a *slot* (a bit position); a key's record holds one int bitmask
  per tier (``l0``, ``l1``), so "which pods still hold the prefix" is one ``&``
  per key no matter how many pods the fleet has;
* the map is an ``OrderedDict`` used as an LRU: ``move_to_end`` is O(1) and a
  lookup touches every key it walks, so hot prefixes survive eviction;
* per-pod key sets make ``drop_pod``/``Cleared`` O(keys that pod holds), not a
  scan of the whole index.

L2 is fleet-wide: one ``Stored(L2)`` makes the key available to every pod and
one ``Removed(L2)`` from any pod removes it. The record keeps which pod *wrote*
the key so benchmarks can count cross-pod hits (``l2_writers_now``).

Speculative entries (``speculate``) say "the router just sent this prompt to
that pod, so it will hold these blocks in L0 in a moment". They count as L0
until their deadline unless a real ``Stored(L0)`` confirms them first.

Sizing: about 290 bytes per key held by two pods (``KEY_BYTES``: record, per-pod set
entries, the key int), so ``capacity_keys=1_000_000`` is ~290 MB.

Every method has a synchronous ``*_now`` twin for the discrete-event simulator,
which drives the store with its own virtual ``clock``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvindex.store import Cleared, IndexOp, IndexStats, Removed, Stored
from kvindex.types import Bound, PodPrefix, PrefixMatch, Tier

KEY_BYTES = 290  # a key held by two pods: record, per-pod set entries, the key (tracemalloc)


class _Entry:
    """Holders of one block key: pod-slot bitmasks per tier, L2 writer, speculation."""

    __slots__ = ("l0", "l1", "l2", "spec")

    def __init__(self) -> None:
        self.l0 = 0  # bit i set: the pod in slot i holds the block in L0 (confirmed)
        self.l1 = 0
        self.l2: str | None = None  # pod that wrote the fleet-wide L2 copy
        self.spec: dict[int, float] | None = None  # slot -> deadline of a speculative L0

    def empty(self) -> bool:
        return not (self.l0 or self.l1 or self.spec or self.l2 is not None)


def _bits(mask: int) -> Iterable[int]:
    """Slot numbers of the set bits of ``mask``."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class MemoryStore:
    """Bounded in-memory index (LRU over block keys); see the module docstring."""

    backend = "memory"

    def __init__(self, capacity_keys: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_keys < 1:
            raise ValueError("capacity_keys must be >= 1")
        self.capacity = capacity_keys
        self._clock = clock
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._slot_of: dict[str, int] = {}
        self._pods: list[str | None] = []  # slot -> pod name (None: free)
        self._free: list[int] = []
        self._pod_keys: list[set[int]] = []  # slot -> keys with any l0/l1/spec bit of it
        self._counts: list[list[int]] = []  # slot -> [n L0, n L1]
        self._l2_keys: dict[str, set[int]] = {}  # writer pod -> its L2 keys
        self.bad_ops = 0  # ops of an unknown type, counted and skipped

    # -- protocol (async) ---------------------------------------------------

    async def apply(self, pod: str, ops: Sequence[IndexOp]) -> None:
        self.apply_now(pod, ops)

    async def match(self, keys: Sequence[int], block_size: int) -> PrefixMatch:
        return self.match_now(keys, block_size)

    async def speculate(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        """Mark ``pod`` as holding ``keys`` in L0 for ``ttl_s`` unless confirmed sooner."""
        self.speculate_now(pod, keys, ttl_s)

    def speculate_nowait(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        self.speculate_now(pod, keys, ttl_s)

    async def l2_writers(self, keys: Sequence[int]) -> dict[str, int]:
        return self.l2_writers_now(keys)

    async def drop_pod(self, pod: str) -> None:
        self.drop_pod_now(pod)

    async def stats(self) -> IndexStats:
        return self.stats_now()

    async def close(self) -> None:
        return None

    # -- writes ---------------------------------------------------------------

    def apply_now(self, pod: str, ops: Sequence[IndexOp]) -> None:
        for op in ops:
            if isinstance(op, Stored):
                if op.tier is Tier.L2:
                    self._store_l2(pod, op.keys)
                else:
                    self._store_local(self._slot(pod), op.tier, op.keys)
            elif isinstance(op, Removed):
                self._remove(pod, op.tier, op.keys)
            elif isinstance(op, Cleared):
                self._clear(pod, op.tiers)
            else:
                self.bad_ops += 1

    def speculate_now(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        slot = self._slot(pod)
        bit = 1 << slot
        deadline = self._clock() + ttl_s
        pod_keys = self._pod_keys[slot]
        for key in keys:
            e = self._touch_or_add(key)
            if e.l0 & bit:
                continue  # already confirmed: confirmed entries never expire
            if e.spec is None:
                e.spec = {}
            e.spec[slot] = deadline
            pod_keys.add(key)

    def drop_pod_now(self, pod: str) -> None:
        """Forget an ejected pod's L0/L1 entries; its L2 writes stay (shared storage)."""
        slot = self._slot_of.get(pod)
        if slot is None:
            return
        self._clear(pod, (Tier.L0, Tier.L1))
        del self._slot_of[pod]
        self._pods[slot] = None
        self._free.append(slot)

    def _slot(self, pod: str) -> int:
        slot = self._slot_of.get(pod)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
            self._pods[slot] = pod
            self._pod_keys[slot] = set()
            self._counts[slot] = [0, 0]
        else:
            slot = len(self._pods)
            self._pods.append(pod)
            self._pod_keys.append(set())
            self._counts.append([0, 0])
        self._slot_of[pod] = slot
        return slot

    def _touch_or_add(self, key: int) -> _Entry:
        e = self._entries.get(key)
        if e is not None:
            self._entries.move_to_end(key)
            return e
        e = self._entries[key] = _Entry()
        if len(self._entries) > self.capacity:
            old_key, old = self._entries.popitem(last=False)
            self._unlink(old_key, old)
        return e

    def _unlink(self, key: int, e: _Entry) -> None:
        """Drop every secondary reference to an evicted or emptied key."""
        for slot in _bits(e.l0 | e.l1 | sum(1 << s for s in e.spec or ())):
            self._pod_keys[slot].discard(key)
            counts = self._counts[slot]
            counts[0] -= (e.l0 >> slot) & 1
            counts[1] -= (e.l1 >> slot) & 1
        if e.l2 is not None:
            self._discard_l2(e.l2, key)

    def _store_local(self, slot: int, tier: Tier, keys: Sequence[int]) -> None:
        bit = 1 << slot
        counts = self._counts[slot]
        pod_keys = self._pod_keys[slot]
        touch = self._touch_or_add
        for key in keys:
            e = touch(key)
            if tier is Tier.L0:
                if not e.l0 & bit:
                    e.l0 |= bit
                    counts[0] += 1
                if e.spec is not None:
                    e.spec.pop(slot, None)  # confirmed by the engine
            elif not e.l1 & bit:
                e.l1 |= bit
                counts[1] += 1
            pod_keys.add(key)

    def _store_l2(self, pod: str, keys: Sequence[int]) -> None:
        mine = self._l2_keys.setdefault(pod, set())
        for key in keys:
            e = self._touch_or_add(key)
            if e.l2 != pod:
                if e.l2 is not None:
                    self._discard_l2(e.l2, key)
                e.l2 = pod
                mine.add(key)

    def _discard_l2(self, writer: str, key: int) -> None:
        keys = self._l2_keys.get(writer)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._l2_keys[writer]

    def _remove(self, pod: str, tier: Tier, keys: Iterable[int]) -> None:
        if tier is Tier.L2:  # fleet-wide: any pod may remove it
            for key in keys:
                e = self._entries.get(key)
                if e is not None and e.l2 is not None:
                    self._discard_l2(e.l2, key)
                    e.l2 = None
                    self._drop_if_empty(key, e)
            return
        slot = self._slot_of.get(pod)
        if slot is not None:
            for key in keys:
                self._remove_local(slot, tier, key)

    def _remove_local(self, slot: int, tier: Tier, key: int) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        bit = 1 << slot
        counts = self._counts[slot]
        if tier is Tier.L0:
            if e.l0 & bit:
                e.l0 ^= bit
                counts[0] -= 1
            if e.spec is not None:
                e.spec.pop(slot, None)
        elif e.l1 & bit:
            e.l1 ^= bit
            counts[1] -= 1
        if not ((e.l0 | e.l1) & bit or (e.spec and slot in e.spec)):
            self._pod_keys[slot].discard(key)
        self._drop_if_empty(key, e)

    def _drop_if_empty(self, key: int, e: _Entry) -> None:
        if e.empty():
            del self._entries[key]

    def _clear(self, pod: str, tiers: Iterable[Tier]) -> None:
        tiers = set(tiers)
        if Tier.L2 in tiers:  # only what this pod wrote; other pods' files stay
            self._remove(pod, Tier.L2, list(self._l2_keys.get(pod, ())))
        slot = self._slot_of.get(pod)
        if slot is None:
            return
        for key in list(self._pod_keys[slot]):
            for tier in (Tier.L0, Tier.L1):
                if tier in tiers:
                    self._remove_local(slot, tier, key)

    # -- reads ----------------------------------------------------------------

    def match_now(self, keys: Sequence[int], block_size: int) -> PrefixMatch:
        """Per-pod L0 and L0∪L1 prefixes plus the fleet-wide L2 prefix, in one walk."""
        entries = self._entries
        touch = entries.move_to_end
        alive0 = alive01 = 0  # pods whose L0 (resp. L0∪L1) chain is unbroken
        l2_alive = True
        l2 = 0
        ends0: dict[int, int] = {}  # slot -> prefix length once its chain broke
        ends01: dict[int, int] = {}
        n = 0
        for i, key in enumerate(keys):
            e = entries.get(key)
            if e is None:
                break
            touch(key)
            m0 = e.l0
            if e.spec is not None:
                m0 |= self._live_spec(key, e)
                if e.empty():  # only expired speculation was left
                    del entries[key]
                    break
            m01 = m0 | e.l1
            if i == 0:
                alive0, alive01 = m0, m01
            else:
                if alive0 & m0 != alive0:
                    for slot in _bits(alive0 & ~m0):
                        ends0[slot] = i
                    alive0 &= m0
                if alive01 & m01 != alive01:
                    for slot in _bits(alive01 & ~m01):
                        ends01[slot] = i
                    alive01 &= m01
            if l2_alive:
                if e.l2 is None:
                    l2_alive = False
                else:
                    l2 = i + 1
            if not (alive01 or l2_alive):
                break  # nobody holds this key in any tier (or no chain can grow)
            n = i + 1
        for slot in _bits(alive0):
            ends0[slot] = n
        for slot in _bits(alive01):
            ends01[slot] = n
        pods = {
            self._pods[slot] or "": PodPrefix(l0=ends0.get(slot, 0), l0_l1=l01)
            for slot, l01 in ends01.items()
            if l01 > 0
        }
        return PrefixMatch(total_blocks=len(keys), block_size=block_size, pods=pods, l2=l2)

    def _live_spec(self, key: int, e: _Entry) -> int:
        """Bitmask of unexpired speculative L0 holders; prunes expired ones."""
        spec = e.spec or {}
        now = self._clock()
        mask = 0
        for slot, deadline in list(spec.items()):
            if deadline > now:
                mask |= 1 << slot
                continue
            del spec[slot]
            if not ((e.l0 | e.l1) >> slot) & 1:
                self._pod_keys[slot].discard(key)
        if not spec:
            e.spec = None
        return mask

    def l2_writers_now(self, keys: Sequence[int]) -> dict[str, int]:
        """Writer pod -> number of blocks it wrote within the fleet-wide L2 prefix."""
        out: dict[str, int] = {}
        for key in keys:
            e = self._entries.get(key)
            if e is None or e.l2 is None:
                break
            out[e.l2] = out.get(e.l2, 0) + 1
        return out

    def bounds(self) -> dict[str, Bound]:
        return {"index": Bound(len(self._entries), self.capacity, "keys", KEY_BYTES)}

    def stats_now(self) -> IndexStats:
        per_pod: dict[str, dict[str, int]] = {}
        for pod, slot in self._slot_of.items():
            n0, n1 = self._counts[slot]
            per_pod[pod] = {"L0": n0, "L1": n1, "L2": len(self._l2_keys.get(pod, ()))}
        for writer, keys in self._l2_keys.items():
            per_pod.setdefault(writer, {"L0": 0, "L1": 0, "L2": len(keys)})
        return IndexStats(
            backend=self.backend,
            keys=len(self._entries),
            capacity=self.capacity,
            per_pod=per_pod,
            l2_keys=sum(len(k) for k in self._l2_keys.values()),
        )

    def snapshot(self) -> list[tuple[str, list[IndexOp]]]:
        """Confirmed entries as ``Stored`` ops per pod, oldest first (for resyncing Redis)."""
        by_pod: dict[str, dict[Tier, list[int]]] = {}
        for key, e in self._entries.items():
            for tier, mask in ((Tier.L0, e.l0), (Tier.L1, e.l1)):
                for slot in _bits(mask):
                    pod = self._pods[slot] or ""
                    by_pod.setdefault(pod, {}).setdefault(tier, []).append(key)
            if e.l2 is not None:
                by_pod.setdefault(e.l2, {}).setdefault(Tier.L2, []).append(key)
        return [
            (pod, [Stored(tier, keys) for tier, keys in tiers.items()])
            for pod, tiers in by_pod.items()
        ]
