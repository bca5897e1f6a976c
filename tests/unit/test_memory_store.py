"""MemoryStore specifics: capacity, LRU, virtual clock, pod slots, stats, snapshot."""

from __future__ import annotations

import gc

import pytest

from kvindex.memory_store import MemoryStore
from kvindex.store import Cleared, Removed, Stored
from kvindex.types import PodPrefix, Tier

K = [0xD000 + i for i in range(16)]
L0, L1, L2 = Tier.L0, Tier.L1, Tier.L2


def test_capacity_is_never_exceeded_and_the_oldest_keys_go_first() -> None:
    s = MemoryStore(capacity_keys=5)

    s.apply_now("a", [Stored(L0, K[:8])])

    assert s.stats_now().keys == 5
    assert s.match_now(K, 16).pods == {}  # K[0:3] were evicted
    assert s.match_now(K[3:8], 16).pods == {"a": PodPrefix(5, 5)}
    assert s.stats_now().per_pod["a"] == {"L0": 5, "L1": 0, "L2": 0}


def test_a_lookup_touches_keys_so_hot_prefixes_survive_eviction() -> None:
    s = MemoryStore(capacity_keys=4)
    s.apply_now("a", [Stored(L0, K[:4])])

    s.match_now(K[:2], 16)
    s.apply_now("b", [Stored(L0, K[4:6])])  # evicts the two least recently used

    assert s.match_now(K[:2], 16).pods == {"a": PodPrefix(2, 2)}
    assert s.match_now(K[2:4], 16).pods == {}


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        MemoryStore(capacity_keys=0)


def test_speculation_expires_on_the_injected_clock() -> None:
    now = [100.0]
    s = MemoryStore(1000, clock=lambda: now[0])
    s.speculate_now("a", K[:3], ttl_s=5.0)

    now[0] = 104.9
    held = s.match_now(K, 16).pods
    now[0] = 105.0
    expired = s.match_now(K, 16).pods

    assert (held, expired) == ({"a": PodPrefix(3, 3)}, {})
    # the walk pruned K[0] (nothing left) and stopped there; the rest go when walked or by LRU
    assert s.stats_now().keys == 2


def test_a_speculations_deadline_is_rounded_up_to_the_next_eighth_of_a_second() -> None:
    """Speculated again within one step, a prefix keeps its deadline (its keys' states
    are not rewritten); in a later step, the deadline moves on."""
    now = [100.01]
    s = MemoryStore(1000, clock=lambda: now[0])
    s.speculate_now("a", K[:3], ttl_s=5.0)  # ends at 105.125
    now[0] = 100.02
    s.speculate_now("a", K[:3], ttl_s=5.0)  # the same step: still 105.125

    now[0] = 105.1
    held = s.match_now(K, 16).pods
    now[0] = 105.125
    expired = s.match_now(K, 16).pods

    assert (held, expired) == ({"a": PodPrefix(3, 3)}, {})
    now[0] = 200.01
    s.speculate_now("a", K[:3], ttl_s=5.0)
    now[0] = 200.2
    s.speculate_now("a", K[:3], ttl_s=5.0)  # a later step: ends at 205.25
    now[0] = 205.2
    assert s.match_now(K, 16).pods == {"a": PodPrefix(3, 3)}


def test_a_dropped_pods_slot_is_reused_without_its_entries() -> None:
    s = MemoryStore(1000)
    s.apply_now("a", [Stored(L0, K[:3])])
    s.drop_pod_now("a")

    s.apply_now("b", [Stored(L0, K[3:5])])

    assert s.match_now(K, 16).pods == {}
    assert s.match_now(K[3:5], 16).pods == {"b": PodPrefix(2, 2)}
    assert set(s.stats_now().per_pod) == {"b"}


def test_the_per_pod_key_sets_are_never_walked_by_the_garbage_collector() -> None:
    """A full collection walks every entry of a tracked container: the per-pod key sets
    grow to the index's size, so they must be of a kind CPython does not track."""
    s = MemoryStore(1000)
    s.apply_now("a", [Stored(L0, K[:8]), Stored(L1, K[8:10]), Stored(L2, K[10:12])])
    s.speculate_now("b", K[:12], 5.0)  # present keys, run by run
    s.speculate_now("b", K[12:], 5.0)  # a new prompt: one bulk insert
    s.apply_now("a", [Removed(L0, K[:2])])
    gc.collect()

    containers = [*s._pod_keys, *s._l2_keys.values()]
    assert [len(c) for c in containers] == [8, 16, 2]  # a: L0 + L1 less 2 removed; b; a's L2
    assert not any(gc.is_tracked(c) for c in containers)


def test_stats_count_entries_per_pod_and_tier() -> None:
    s = MemoryStore(1000)
    s.apply_now("a", [Stored(L0, K[:3]), Stored(L1, K[:2]), Stored(L2, K[:1])])
    s.apply_now("b", [Stored(L2, K[1:4]), Removed(L0, K[:1])])

    stats = s.stats_now()

    assert (stats.backend, stats.keys, stats.capacity, stats.l2_keys) == ("memory", 4, 1000, 4)
    assert stats.per_pod == {
        "a": {"L0": 3, "L1": 2, "L2": 1},
        "b": {"L0": 0, "L1": 0, "L2": 3},
    }


def test_l0_blocks_now_follows_a_pods_events_until_capacity_makes_it_a_lower_bound() -> None:
    s = MemoryStore(capacity_keys=8)
    assert s.l0_blocks_now("a") == 0  # no event stored anything yet

    s.apply_now("a", [Stored(L0, K[:5]), Stored(L1, K[5:7])])
    s.apply_now("b", [Stored(L0, K[:2])])
    s.speculate_now("a", K[7:8], ttl_s=60.0)  # in flight, not yet held
    assert (s.l0_blocks_now("a"), s.l0_blocks_now("b")) == (5, 2)

    s.apply_now("a", [Removed(L0, K[:2])])
    assert s.l0_blocks_now("a") == 3
    s.apply_now("a", [Cleared()])
    assert s.l0_blocks_now("a") == 0

    s.apply_now("b", [Stored(L0, K[8:16])])  # 8 more keys in an 8-key index: evictions
    assert (s.capacity_evictions > 0, s.l0_blocks_now("b")) == (True, None)
    assert s.l0_blocks_now("c") is None  # every count is a lower bound now, even 0


def test_l2_rewritten_by_another_pod_moves_the_writer() -> None:
    s = MemoryStore(1000)
    s.apply_now("a", [Stored(L2, K[:3])])
    s.apply_now("b", [Stored(L2, K[1:2])])

    assert s.l2_writers_now(K) == {"a": 2, "b": 1}
    assert s.stats_now().per_pod["a"]["L2"] == 2


def test_snapshot_rebuilds_the_same_confirmed_view_elsewhere() -> None:
    s = MemoryStore(1000)
    s.apply_now("a", [Stored(L0, K[:4]), Stored(L1, K[:6])])
    s.apply_now("b", [Stored(L2, K[:5]), Stored(L1, K[:2])])
    s.speculate_now("c", K[:3], ttl_s=60)  # speculation is not part of a snapshot

    copy = MemoryStore(1000)
    for pod, ops in s.snapshot():
        copy.apply_now(pod, ops)

    m = copy.match_now(K, 16)
    assert m.pods == {"a": PodPrefix(4, 6), "b": PodPrefix(0, 2)}
    assert m.l2 == 5


def test_unknown_ops_are_counted_and_skipped() -> None:
    s = MemoryStore(1000)

    s.apply_now("a", [object(), Stored(L0, K[:2]), Cleared(())])  # type: ignore[list-item]

    assert s.bad_ops == 1
    assert s.match_now(K, 16).pods == {"a": PodPrefix(2, 2)}


def test_match_on_2048_keys_held_by_8_pods_gives_each_pod_its_own_prefix() -> None:
    """Eight chains breaking at different depths: the walk's runs of equal states must
    still end each pod's prefix where its own chain ends (speed: `kvgate bench index`)."""
    s = MemoryStore(100_000)
    keys = list(range(1, 2049))
    for p in range(8):
        s.apply_now(f"pod-{p}", [Stored(L0, keys[: 2048 - 100 * p]), Stored(L1, keys)])

    m = s.match_now(keys, 16)

    assert m.pods == {f"pod-{p}": PodPrefix(2048 - 100 * p, 2048) for p in range(8)}
