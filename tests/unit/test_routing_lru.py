"""BoundedLRU: hard capacity, recency by write/touch only; registry names still resolve."""

import pytest

from routing.lru import BoundedLRU
from routing.strategy_registry import available, canonical_name


def test_the_oldest_entry_is_evicted_at_capacity():
    lru: BoundedLRU[int, str] = BoundedLRU(2)
    lru.put(1, "a")
    lru.put(2, "b")
    lru.put(3, "c")
    assert (list(lru), len(lru), lru.evictions) == ([2, 3], 2, 1)


def test_get_does_not_refresh_but_touch_and_put_do():
    lru: BoundedLRU[int, str] = BoundedLRU(2)
    lru.put(1, "a")
    lru.put(2, "b")
    assert lru.get(1) == "a"  # a read keeps 1 the oldest
    lru.put(3, "c")
    assert list(lru) == [2, 3]
    lru.touch(2)
    lru.touch(99)  # absent: no-op
    lru.put(4, "d")
    assert list(lru) == [2, 4]
    lru.put(2, "B")  # replace refreshes
    lru.put(5, "e")
    assert (list(lru), lru.get(2), lru.get(4)) == ([2, 5], "B", None)


def test_pop_and_clear():
    lru: BoundedLRU[str, int] = BoundedLRU(3)
    lru.put("x", 1)
    assert (lru.pop("x"), lru.pop("x"), "x" in lru) == (1, None, False)
    lru.put("y", 2)
    lru.clear()
    assert len(lru) == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        BoundedLRU(0)


def test_every_strategy_and_hyperpod_alias_resolves():
    assert available() == ["kv-aware", "least-loaded", "prefix-aware", "round-robin", "session"]
    names = {
        "roundrobin": "round-robin",
        "prefixaware": "prefix-aware",
        "kvaware": "kv-aware",
        "session": "session",
        "least_loaded": "least-loaded",
    }
    assert {alias: canonical_name(alias) for alias in names} == names
