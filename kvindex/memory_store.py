"""In-process ``IndexStore``: a bounded LRU map from router block key to holders.

Why this shape: the gateway does one ``match`` per request over up to a few
thousand keys and applies ~100k block events per second, all in pure Python on
the event loop, so a lookup must not cost a Python loop iteration per key:

* a key maps to an immutable *state*, ``(l0, l1, l2, spec)``: one int bitmask of
  pod *slots* per local tier (so "which pods still hold the prefix" is one ``&``
  however large the fleet), the pod that wrote the fleet-wide L2 copy, and the
  speculative L0 holders as ``((slot, deadline), ...)``. A write replaces states;
  the keys one op changes alike share one new state (a transition is computed once
  per distinct old state), so a chain held alike is one object repeated;
* a lookup reads its keys' states with a C-level ``map`` in growing chunks (to
  the first absent key), then ``itertools.groupby`` folds equal neighbours: the
  Python walk runs once per *run* of blocks held alike, not once per block. A
  32k-token prompt cached by the same pods throughout is a few runs instead of
  2,048 iterations (the remaining per-key cost is C: one dict read and one LRU
  touch per key);
* the map is an ``OrderedDict`` used as an LRU (``move_to_end`` is O(1)): writes
  touch their keys and a lookup touches every key it walks, so hot prefixes
  survive eviction. A lookup's touches wait for the next write or snapshot, which
  applies them first, in order (``kvindex.touch_queue``: the order is exactly
  what touching at once would make, and a repeated walk, or the router's
  speculation right after its lookup, saves the touches altogether);
* per-pod key sets make ``drop_pod``/``Cleared`` O(keys that pod holds), not a
  scan of the whole index. They are ``dict[int, None]`` (``KeySet``), not ``set``:
  CPython's cyclic collector never tracks a dict of ints and None, but walks every
  entry of a set on each full collection: in a full index of 2M keys a full
  collection took 103-114 ms with sets, a pause for every request in flight, and 6-7
  ms with dicts (the last line of ``kvgate bench index``);
* at capacity every new prompt evicts as many keys as it adds; keys evicted together
  were mostly written together, so their per-pod entries go a run of equal states
  at a time (``_evict_beyond_capacity``): a new 100-block prompt's lookup and
  speculation in a full index, p50 201-209 µs before, 132-137 after.

Chain summaries per 16-block group (what ``RedisStore`` keeps, from the ops'
``Positions``) would cut the reads further, but every write would then have to
find and rewrite the summaries that include its key; reading a state here is a
C-level dict lookup, so folding equal neighbours at read time gets most of the
gain with no write-side bookkeeping. Ops' ``Positions`` are ignored.

L2 is fleet-wide: one ``Stored(L2)`` makes the key available to every pod and
one ``Removed(L2)`` from any pod removes it. The state keeps which pod *wrote*
the key so benchmarks can count cross-pod hits (``l2_writers_now``).

Speculative entries (``speculate``) say "the router just sent this prompt to
that pod, so it will hold these blocks in L0 in a moment". They count as L0
until their deadline (the TTL from the write, rounded up to the next 1/8 s:
``block_state.spec_deadline``) unless a real ``Stored(L0)`` confirms them first. A lookup
that reaches a key only expired speculation held drops that key and stops there;
the keys it walks forget their expired speculation (one new state per run).

Sizing: about 245 bytes per key held by two pods (``KEY_BYTES``: the map's entry
and LRU node, the key int, per-pod set entries; states are shared), so
``capacity_keys=1_000_000`` is ~245 MB; queued lookup touches add at most
65,536 references (~0.5 MB).

Every method has a synchronous ``*_now`` twin for the discrete-event simulator,
which drives the store with its own virtual ``clock``.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from itertools import groupby, islice, repeat
from operator import itemgetter

from kvindex.block_state import (
    Spec,
    State,
    bits,
    live_slots,
    removed,
    spec_deadline,
    spec_slots,
    speculated,
    stored,
)
from kvindex.store import Cleared, IndexOp, IndexStats, Removed, Stored
from kvindex.touch_queue import TouchQueue
from kvindex.types import Bound, PodPrefix, PrefixMatch, Tier

# a key held by two pods, its state shared with its chain's (tracemalloc, CPython 3.11)
KEY_BYTES = 245

# Keys as a dict's keys, every value None: what the GC never walks (module docstring).
KeySet = dict[int, None]

_FIRST_CHUNK = 64  # keys read before the first check for an absent one (x8 each round)
_WRITER = itemgetter(2)
_STATE = itemgetter(1)  # of an (key, state) item


def _discard(held: KeySet, keys: Iterable[int]) -> None:
    """Remove ``keys`` from ``held`` where present, at C speed."""
    deque(map(held.pop, keys, repeat(None)), maxlen=0)


class MemoryStore:
    """Bounded in-memory index (LRU over block keys); see the module docstring."""

    backend = "memory"

    def __init__(self, capacity_keys: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity_keys < 1:
            raise ValueError("capacity_keys must be >= 1")
        self.capacity = capacity_keys
        self._clock = clock
        self._entries: OrderedDict[int, State] = OrderedDict()
        self._slot_of: dict[str, int] = {}
        self._pods: list[str | None] = []  # slot -> pod name (None: free)
        self._free: list[int] = []
        self._pod_keys: list[KeySet] = []  # slot -> keys with any l0/l1/spec bit of it
        self._counts: list[list[int]] = []  # slot -> [n L0, n L1]
        self._l2_keys: dict[str, KeySet] = {}  # writer pod -> its L2 keys
        self._touches = TouchQueue(self._entries)  # lookups' LRU touches, applied by writes
        # the last lookup's walked keys and their states (a run at a time), while no
        # write has changed any state since: what the speculation after it starts from
        self._last_walk: tuple[tuple[int, ...], list[tuple[State, int]]] | None = None
        self.bad_ops = 0  # ops of an unknown type, counted and skipped
        # Keys dropped for capacity (not by a pod's event): from the first one on, the
        # per-pod counts are lower bounds of what the pods hold.
        self.capacity_evictions = 0

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
        self._touches.apply()
        self._last_walk = None
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
        """Mark ``pod`` as holding ``keys`` in L0 until ``ttl_s`` from now, unless confirmed.

        The present head of ``keys`` is done a run of equal states at a time (touch;
        if the pod has not confirmed the run, one new state for it), the rest key by
        key. The router speculates the prompt it has just looked up: when that lookup's
        walk is a prefix of ``keys`` and nothing was written since, the walk's runs are
        still the keys' runs; otherwise (a sibling worker's speculation, applied before
        a lookup) the head is read as a lookup reads it."""
        walked = self._touches.apply(then=keys)
        last, self._last_walk = self._last_walk, None
        slot = self._slot(pod)
        deadline = spec_deadline(self._clock(), ttl_s)
        if walked is not None and last is not None and last[0] is walked:
            runs = last[1]
        else:
            runs = [(state, len(list(run))) for state, run in groupby(self._held_prefix(keys))]
        done = 0
        for state, count in runs:
            self._speculate_run(keys[done : done + count], state, slot, deadline)
            done += count
        self._speculate_keys(keys[done:] if done else keys, slot, deadline)

    def _speculate_run(self, keys: Sequence[int], state: State, slot: int, deadline: float) -> None:
        """Speculate present keys that share ``state``, in order."""
        entries = self._entries
        deque(map(entries.move_to_end, keys), maxlen=0)
        if state[0] >> slot & 1:
            return  # confirmed entries never expire
        new = speculated(state, slot, deadline)
        if new is state:
            return  # speculated within this deadline step already
        entries.update(zip(keys, repeat(new)))  # present keys keep their place
        if not (state[1] | spec_slots(state[3])) >> slot & 1:  # else its key set has them
            self._pod_keys[slot].update(zip(keys, repeat(None)))

    def _speculate_keys(self, keys: Sequence[int], slot: int, deadline: float) -> None:
        bit = 1 << slot
        entries = self._entries
        pod_keys = self._pod_keys[slot]
        fresh: State = (0, 0, None, ((slot, deadline),))
        if len(keys) <= self.capacity and not any(map(entries.__contains__, keys)):
            # A prompt no pod holds (a new one, or a sibling worker's speculation of
            # one): the loop below would add each key in order and evict the oldest
            # beyond capacity, which is this, at C speed.
            entries.update(zip(keys, repeat(fresh)))
            pod_keys.update(zip(keys, repeat(None)))
            self._evict_beyond_capacity()
            return
        memo: dict[int, tuple[State, State]] = {}  # id(old) -> (old, new): one per state
        for key in keys:
            old = entries.get(key)
            if old is None:
                self._add(key, fresh)
            else:
                entries.move_to_end(key)
                if old[0] & bit:
                    continue  # already confirmed: confirmed entries never expire
                hit = memo.get(id(old))
                if hit is None:
                    hit = memo[id(old)] = (old, speculated(old, slot, deadline))
                if hit[1] is not old:
                    entries[key] = hit[1]
            pod_keys[key] = None

    def drop_pod_now(self, pod: str) -> None:
        """Forget an ejected pod's L0/L1 entries; its L2 writes stay (shared storage)."""
        self._touches.apply()
        self._last_walk = None
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
            self._pod_keys[slot] = {}
            self._counts[slot] = [0, 0]
        else:
            slot = len(self._pods)
            self._pods.append(pod)
            self._pod_keys.append({})
            self._counts.append([0, 0])
        self._slot_of[pod] = slot
        return slot

    def _add(self, key: int, state: State) -> None:
        """Insert a new key as most recent; evict the least recently used beyond capacity."""
        entries = self._entries
        entries[key] = state
        if len(entries) > self.capacity:
            old_key, old = entries.popitem(last=False)
            self._unlink(old_key, old)
            self.capacity_evictions += 1

    def _evict_beyond_capacity(self) -> None:
        """Drop the least recently used keys beyond capacity, at once. At capacity every
        new prompt evicts as many keys as it adds, and the keys evicted together were
        mostly written together (a chain, one shared state): their per-pod entries and
        counts go a run of equal states at a time, not a Python call per key."""
        excess = len(self._entries) - self.capacity
        if excess <= 0:
            return
        popitem = self._entries.popitem
        evicted = [popitem(last=False) for _ in range(excess)]
        self.capacity_evictions += excess
        for state, run in groupby(evicted, key=_STATE):
            self._unlink_run([key for key, _ in run], state)

    def _unlink_run(self, keys: Sequence[int], state: State) -> None:
        """Drop every secondary reference to evicted keys that were all in ``state``."""
        l0, l1, writer, spec = state
        n = len(keys)
        for slot in bits(l0 | l1 | spec_slots(spec)):
            _discard(self._pod_keys[slot], keys)
            counts = self._counts[slot]
            counts[0] -= n * ((l0 >> slot) & 1)
            counts[1] -= n * ((l1 >> slot) & 1)
        if writer is not None:
            mine = self._l2_keys.get(writer)
            if mine is not None:
                _discard(mine, keys)
                if not mine:
                    del self._l2_keys[writer]

    def _unlink(self, key: int, state: State) -> None:
        """``_unlink_run`` of one key, what a key-by-key write (an event's) evicts;
        written out for one key, like ``_discard_l2``: the run's list, ``groupby`` and
        ``map`` cost more than they save on a single key, once per stored block."""
        l0, l1, writer, spec = state
        for slot in bits(l0 | l1 | spec_slots(spec)):
            self._pod_keys[slot].pop(key, None)
            counts = self._counts[slot]
            counts[0] -= (l0 >> slot) & 1
            counts[1] -= (l1 >> slot) & 1
        if writer is not None:
            self._discard_l2(writer, key)

    def _store_local(self, slot: int, tier: Tier, keys: Sequence[int]) -> None:
        bit = 1 << slot
        is_l0 = tier is Tier.L0
        entries = self._entries
        pod_keys = self._pod_keys[slot]
        fresh: State = (bit, 0, None, None) if is_l0 else (0, bit, None, None)
        memo: dict[int, tuple[State, State, int]] = {}  # id(old) -> (old, new, gained)
        gained = 0  # keys that gain this pod in this tier
        for key in keys:
            old = entries.get(key)
            if old is None:
                self._add(key, fresh)
                gained += 1
            else:
                entries.move_to_end(key)
                hit = memo.get(id(old))
                if hit is None:
                    hit = memo[id(old)] = stored(old, slot, bit, is_l0)
                if hit[1] is not old:
                    entries[key] = hit[1]
                    gained += hit[2]
            pod_keys[key] = None
        self._counts[slot][0 if is_l0 else 1] += gained

    def _store_l2(self, pod: str, keys: Sequence[int]) -> None:
        entries = self._entries
        mine: KeySet = self._l2_keys.setdefault(pod, {})
        fresh: State = (0, 0, pod, None)
        memo: dict[int, tuple[State, State]] = {}  # id(old) -> (old, new): one per state
        for key in keys:
            old = entries.get(key)
            if old is None:
                self._add(key, fresh)
            else:
                entries.move_to_end(key)
                if old[2] == pod:
                    continue
                if old[2] is not None:
                    self._discard_l2(old[2], key)
                hit = memo.get(id(old))
                if hit is None:
                    hit = memo[id(old)] = (old, (old[0], old[1], pod, old[3]))
                entries[key] = hit[1]
            # an eviction may have emptied and dropped this pod's set meanwhile
            mine = self._l2_keys.setdefault(pod, mine)
            mine[key] = None

    def _discard_l2(self, writer: str, key: int) -> None:
        keys = self._l2_keys.get(writer)
        if keys is not None:
            keys.pop(key, None)
            if not keys:
                del self._l2_keys[writer]

    def _remove(self, pod: str, tier: Tier, keys: Iterable[int]) -> None:
        if tier is Tier.L2:  # fleet-wide: any pod may remove it
            entries = self._entries
            memo: dict[int, tuple[State, State]] = {}
            for key in keys:
                old = entries.get(key)
                if old is not None and old[2] is not None:
                    self._discard_l2(old[2], key)
                    if old[0] or old[1] or old[3]:
                        hit = memo.get(id(old))
                        if hit is None:
                            hit = memo[id(old)] = (old, (old[0], old[1], None, old[3]))
                        entries[key] = hit[1]
                    else:
                        del entries[key]
            return
        slot = self._slot_of.get(pod)
        if slot is not None:
            self._remove_local(slot, tier, keys)

    def _remove_local(self, slot: int, tier: Tier, keys: Iterable[int]) -> None:
        bit = 1 << slot
        is_l0 = tier is Tier.L0
        entries = self._entries
        pod_keys = self._pod_keys[slot]
        memo: dict[int, tuple[State, State, int]] = {}  # id(old) -> (old, new, lost)
        lost = 0
        for key in keys:
            old = entries.get(key)
            if old is None:
                continue
            hit = memo.get(id(old))
            if hit is None:
                hit = memo[id(old)] = removed(old, slot, bit, is_l0)
            new = hit[1]
            lost += hit[2]
            l0, l1, writer, spec = new
            if not ((l0 | l1 | spec_slots(spec)) & bit):
                pod_keys.pop(key, None)
            if not (l0 or l1 or spec or writer is not None):
                del entries[key]
            elif new is not old:
                entries[key] = new
        self._counts[slot][0 if is_l0 else 1] -= lost

    def _clear(self, pod: str, tiers: Iterable[Tier]) -> None:
        tiers = set(tiers)
        if Tier.L2 in tiers:  # only what this pod wrote; other pods' files stay
            self._remove(pod, Tier.L2, list(self._l2_keys.get(pod, ())))
        slot = self._slot_of.get(pod)
        if slot is None:
            return
        for tier in (Tier.L0, Tier.L1):
            if tier in tiers:
                self._remove_local(slot, tier, list(self._pod_keys[slot]))

    # -- reads ----------------------------------------------------------------

    def _held_prefix(self, keys: Sequence[int]) -> list[State]:
        """States of ``keys`` up to the first absent one: the first key alone (a prompt
        no pod has seen costs one read, a cache miss in a large index), then growing
        chunks (a prompt's uncached tail costs at most as many reads as its cached head)."""
        get = self._entries.get
        first = get(keys[0]) if keys else None
        if first is None:
            return []
        states: list[State] = [first]
        start, step, total = 1, _FIRST_CHUNK, len(keys)
        while start < total:
            chunk = list(map(get, keys[start : start + step]))
            try:
                cut = chunk.index(None)  # type: ignore[arg-type]
            except ValueError:
                states += chunk  # type: ignore[arg-type]
                start, step = start + step, step * 8
                continue
            states += chunk[:cut]  # type: ignore[arg-type]
            break
        return states

    def match_now(self, keys: Sequence[int], block_size: int) -> PrefixMatch:
        """Per-pod L0 and L0∪L1 prefixes plus the fleet-wide L2 prefix, one step per
        run of keys held alike (see the module docstring)."""
        states = self._held_prefix(keys)
        walked = len(states)  # keys the walk reaches, so touches
        now: float | None = None
        alive0 = alive01 = 0  # pods whose L0 (resp. L0∪L1) chain is unbroken
        l2_alive = True
        l2 = 0
        ends0: dict[int, int] = {}  # slot -> prefix length once its chain broke
        ends01: dict[int, int] = {}
        n = 0  # blocks walked past: the run being looked at starts here
        live = 0
        runs: list[tuple[State, int]] = []  # the walked keys' states, for a speculation
        for state, run in groupby(states):
            length = len(list(run))
            l0, l1, writer, spec = state
            m0 = l0
            if spec is not None:
                now = self._clock() if now is None else now
                live = live_slots(spec, now)
                m0 |= live
                if not (m0 or l1 or writer is not None):  # only expired speculation left
                    self._drop_expired(keys[n], spec)
                    walked = n
                    break
            m01 = m0 | l1
            if n == 0:
                alive0, alive01 = m0, m01
            else:
                if alive0 & m0 != alive0:
                    for slot in bits(alive0 & ~m0):
                        ends0[slot] = n
                    alive0 &= m0
                if alive01 & m01 != alive01:
                    for slot in bits(alive01 & ~m01):
                        ends01[slot] = n
                    alive01 &= m01
            l2_alive = l2_alive and writer is not None
            # nobody holds this key in any tier (or no chain can grow)
            stop = not (alive01 or l2_alive)
            if spec is not None and live != spec_slots(spec):  # the walked keys forget it
                state = self._prune_expired(keys[n : n + (1 if stop else length)], state, live)
            runs.append((state, 1 if stop else length))
            if stop:
                walked = n + 1
                break
            n += length
            if l2_alive:
                l2 = n
        if walked:
            self._last_walk = (tuple(islice(keys, walked)), runs)
            self._touches.defer(self._last_walk[0])
        for slot in bits(alive0):
            ends0[slot] = n
        for slot in bits(alive01):
            ends01[slot] = n
        return PrefixMatch(len(keys), block_size, self._prefixes(ends0, ends01), l2)

    def _prefixes(self, ends0: dict[int, int], ends01: dict[int, int]) -> dict[str, PodPrefix]:
        return {
            self._pods[slot] or "": PodPrefix(l0=ends0.get(slot, 0), l0_l1=l01)
            for slot, l01 in ends01.items()
            if l01 > 0
        }

    def _prune_expired(self, keys: Sequence[int], state: State, live: int) -> State:
        """Forget the expired speculation of a run of keys in ``state`` (one shared
        new state, returned; ``OrderedDict.update`` of present keys keeps their order)."""
        l0, l1, writer, spec = state
        kept = tuple(p for p in spec or () if (live >> p[0]) & 1) or None
        new = (l0, l1, writer, kept)
        self._entries.update(zip(keys, repeat(new)))
        for slot in bits(spec_slots(spec) & ~live & ~(l0 | l1)):
            _discard(self._pod_keys[slot], keys)
        return new

    def _drop_expired(self, key: int, spec: Spec) -> None:
        """A key only expired speculation held: gone, like any emptied key."""
        del self._entries[key]
        self._last_walk = None  # it may have walked this key
        for slot in bits(spec_slots(spec)):
            self._pod_keys[slot].pop(key, None)

    def l2_writers_now(self, keys: Sequence[int]) -> dict[str, int]:
        """Writer pod -> number of blocks it wrote within the fleet-wide L2 prefix."""
        out: dict[str, int] = {}
        for writer, run in groupby(self._held_prefix(keys), key=_WRITER):
            if writer is None:
                break
            out[writer] = out.get(writer, 0) + len(list(run))
        return out

    def l0_blocks_now(self, pod: str) -> int | None:
        """Blocks ``pod``'s events put in its L0 and have not removed (its prefix cache's
        occupancy): 0 for a pod whose events stored nothing yet; None once this index
        has dropped keys for its own capacity (every count is then only a lower bound).
        Whether ``pod``'s events are followed at all is the caller's to know."""
        if self.capacity_evictions:
            return None
        slot = self._slot_of.get(pod)
        return 0 if slot is None else self._counts[slot][0]

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
        self._touches.apply()
        by_pod: dict[str, dict[Tier, list[int]]] = {}
        for key, (l0, l1, writer, _) in self._entries.items():
            for tier, mask in ((Tier.L0, l0), (Tier.L1, l1)):
                for slot in bits(mask):
                    pod = self._pods[slot] or ""
                    by_pod.setdefault(pod, {}).setdefault(tier, []).append(key)
            if writer is not None:
                by_pod.setdefault(writer, {}).setdefault(Tier.L2, []).append(key)
        return [
            (pod, [Stored(tier, keys) for tier, keys in tiers.items()])
            for pod, tiers in by_pod.items()
        ]
