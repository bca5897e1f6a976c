"""MemoryStore against a plain reference model, over random histories.

The reference keeps the obvious data (per key: the pods holding it in L0 and in L1,
the L2 writer, speculative deadlines per pod) in an LRU map and answers a lookup
by walking one key at a time, the way the store's contract reads: a lookup touches
every key it reaches, stops at the first key nobody holds (or that only expired
speculation held: that key is dropped), and a write touches or adds its keys and
evicts the least recently used beyond the capacity. Random histories on a small
capacity (so eviction, speculation expiry and slot reuse all happen) must give the
same lookups, L2 writers, stats and key count in both, after every step.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field

import pytest

from kvindex.memory_store import MemoryStore
from kvindex.store import Cleared, IndexOp, Removed, Stored
from kvindex.types import PodPrefix, PrefixMatch, Tier

KEYS = [0xE000 + i for i in range(48)]
PODS = ["a", "b", "c", "d", "e"]


@dataclass
class _Held:
    l0: set[str] = field(default_factory=set)
    l1: set[str] = field(default_factory=set)
    l2: str | None = None
    spec: dict[str, float] = field(default_factory=dict)

    def empty(self) -> bool:
        return not (self.l0 or self.l1 or self.spec or self.l2 is not None)


class Reference:
    """The store's contract, one key at a time."""

    def __init__(self, capacity: int, clock: list[float]) -> None:
        self.capacity = capacity
        self.clock = clock
        self.entries: OrderedDict[int, _Held] = OrderedDict()
        self.known: set[str] = set()  # pods with a slot (stored L0/L1 or speculated)

    def _touch_or_add(self, key: int) -> _Held:
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        held = self.entries[key] = _Held()
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return held

    def _drop_if_empty(self, key: int) -> None:
        if self.entries[key].empty():
            del self.entries[key]

    def apply(self, pod: str, ops: list[IndexOp]) -> None:
        for op in ops:
            if isinstance(op, Stored):
                if op.tier is not Tier.L2:
                    self.known.add(pod)
                for key in op.keys:
                    held = self._touch_or_add(key)
                    if op.tier is Tier.L0:
                        held.l0.add(pod)
                        held.spec.pop(pod, None)
                    elif op.tier is Tier.L1:
                        held.l1.add(pod)
                    else:
                        held.l2 = pod
            elif isinstance(op, Removed):
                for key in op.keys:
                    self._remove(pod, op.tier, key)
            elif isinstance(op, Cleared):
                self._clear(pod, op.tiers)

    def _remove(self, pod: str, tier: Tier, key: int) -> None:
        held = self.entries.get(key)
        if held is None or (tier is not Tier.L2 and pod not in self.known):
            return
        if tier is Tier.L0:
            held.l0.discard(pod)
            held.spec.pop(pod, None)
        elif tier is Tier.L1:
            held.l1.discard(pod)
        else:
            held.l2 = None
        self._drop_if_empty(key)

    def _clear(self, pod: str, tiers: tuple[Tier, ...]) -> None:
        for key in list(self.entries):
            for tier in (Tier.L2, Tier.L0, Tier.L1):
                held = self.entries.get(key)
                if tier in tiers and held is not None and (tier is not Tier.L2 or held.l2 == pod):
                    self._remove(pod, tier, key)

    def speculate(self, pod: str, keys: list[int], ttl_s: float) -> None:
        self.known.add(pod)
        for key in keys:
            held = self._touch_or_add(key)
            if pod not in held.l0:
                # the TTL from now, rounded up to the next 1/8 s (the store's contract)
                held.spec[pod] = math.ceil((self.clock[0] + ttl_s) * 8) / 8

    def drop_pod(self, pod: str) -> None:
        if pod in self.known:
            self._clear(pod, (Tier.L0, Tier.L1))
            self.known.discard(pod)

    def match(self, keys: list[int]) -> PrefixMatch:
        walked: list[tuple[set[str], set[str], bool]] = []
        for key in keys:
            held = self.entries.get(key)
            if held is None:
                break
            self.entries.move_to_end(key)
            held.spec = {p: d for p, d in held.spec.items() if d > self.clock[0]}
            if held.empty():
                del self.entries[key]
                break
            l0 = held.l0 | set(held.spec)
            walked.append((l0, l0 | held.l1, held.l2 is not None))
            still = set.intersection(*(w[1] for w in walked))
            if not still and not all(w[2] for w in walked):
                walked.pop()
                break
        pods = {}
        for pod in set().union(*(w[1] for w in walked)) if walked else set():
            l01 = _leading(walked, lambda w, p=pod: p in w[1])
            if l01:
                pods[pod] = PodPrefix(_leading(walked, lambda w, p=pod: p in w[0]), l01)
        return PrefixMatch(len(keys), 16, pods, _leading(walked, lambda w: w[2]))

    def l2_writers(self, keys: list[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for key in keys:
            held = self.entries.get(key)
            if held is None or held.l2 is None:
                break
            out[held.l2] = out.get(held.l2, 0) + 1
        return out

    def stats(self) -> tuple[int, dict[str, dict[str, int]]]:
        per_pod = {
            pod: {
                "L0": sum(pod in h.l0 for h in self.entries.values()),
                "L1": sum(pod in h.l1 for h in self.entries.values()),
                "L2": sum(h.l2 == pod for h in self.entries.values()),
            }
            for pod in self.known
        }
        writers = [h.l2 for h in self.entries.values() if h.l2 is not None]
        for writer in set(writers) - set(per_pod):
            per_pod[writer] = {"L0": 0, "L1": 0, "L2": writers.count(writer)}
        return len(self.entries), per_pod


def _leading(walked: list[tuple[set[str], set[str], bool]], held) -> int:  # noqa: ANN001
    n = 0
    for w in walked:
        if not held(w):
            break
        n += 1
    return n


def _random_keys(rng: random.Random) -> list[int]:
    start = rng.randrange(len(KEYS))
    return KEYS[start : start + rng.randrange(1, 30)]


def _step(rng: random.Random, store: MemoryStore, ref: Reference, clock: list[float]) -> None:
    pod = rng.choice(PODS)
    roll = rng.random()
    if roll < 0.03:
        store.drop_pod_now(pod)
        ref.drop_pod(pod)
    elif roll < 0.06:
        tiers = tuple(rng.sample(list(Tier), rng.randint(1, 3)))
        store.apply_now(pod, [Cleared(tiers)])
        ref.apply(pod, [Cleared(tiers)])
    elif roll < 0.2:
        keys, ttl = _random_keys(rng), rng.choice([0.5, 2.0, 10.0])
        store.speculate_now(pod, keys, ttl)
        ref.speculate(pod, keys, ttl)
    elif roll < 0.3:  # what the router does: a lookup, then speculation of the same prompt
        keys, ttl = _random_keys(rng), rng.choice([0.5, 2.0, 10.0])
        assert store.match_now(keys, 16) == ref.match(keys)
        store.speculate_now(pod, keys, ttl)
        ref.speculate(pod, keys, ttl)
    elif roll < 0.4:
        clock[0] += rng.choice([0.3, 1.0, 3.0])
    else:
        kind = Stored if roll < 0.75 else Removed
        ops: list[IndexOp] = [
            kind(rng.choice(list(Tier)), _random_keys(rng)) for _ in range(rng.randint(1, 3))
        ]
        store.apply_now(pod, ops)
        ref.apply(pod, ops)


@pytest.mark.parametrize("seed", range(12))
def test_lookups_writes_and_eviction_agree_with_the_reference_model(seed: int) -> None:
    rng = random.Random(seed)
    clock = [1000.0]
    capacity = rng.choice([12, 30, 1000])
    store = MemoryStore(capacity, clock=lambda: clock[0])
    ref = Reference(capacity, clock)
    lookups: list[list[int]] = [KEYS]
    for step in range(400):
        _step(rng, store, ref, clock)
        for _ in range(rng.randint(1, 3)):  # the same walks again, before any write
            keys = rng.choice(lookups) if rng.random() < 0.4 else _random_keys(rng)
            lookups.append(keys)
            assert store.match_now(keys, 16) == ref.match(keys), step
            assert store.l2_writers_now(keys) == ref.l2_writers(keys), step
        stats = store.stats_now()
        assert (stats.keys, stats.per_pod) == ref.stats(), step
        if step % 50 == 49:  # the LRU order itself (a snapshot applies waiting touches)
            store.snapshot()
            assert list(store._entries) == list(ref.entries), step
