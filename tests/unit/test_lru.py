"""BoundedLRU: hard capacity in entries or weight units, recency by write/touch only."""

import pytest

from kvindex.lru import BoundedLRU


def test_the_oldest_entry_is_evicted_at_capacity():
    lru: BoundedLRU[int, str] = BoundedLRU(2)
    lru.put(1, "a")
    lru.put(2, "b")
    lru.put(3, "c")
    assert (list(lru), len(lru), lru.size, lru.evictions) == ([2, 3], 2, 2, 1)


def test_get_does_not_refresh_but_touch_and_put_do():
    lru: BoundedLRU[int, str] = BoundedLRU(2)
    lru.put(1, "a")
    lru.put(2, "b")
    assert lru.get(1) == "a"  # a read keeps 1 the oldest
    lru.put(3, "c")
    assert list(lru) == [2, 3]
    assert (lru.touch(2), lru.touch(99)) == ("b", None)  # absent: no-op
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
    assert (len(lru), lru.size) == (0, 0)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        BoundedLRU(0)


def test_a_weighted_map_evicts_oldest_entries_until_the_total_weight_fits():
    lru: BoundedLRU[str, str] = BoundedLRU(5, weigh=len)
    lru.put("a", "xxx")
    lru.put("b", "xx")
    assert lru.touch("a") == "xxx"  # b is now the oldest
    lru.put("c", "x")  # 6 units: b goes
    assert (list(lru), lru.size, lru.evictions) == (["a", "c"], 4, 1)
    lru.put("d", "xxxx")  # 8 units: a, then nothing more (c + d = 5)
    assert (list(lru), lru.size, lru.evictions) == (["c", "d"], 5, 2)


def test_a_weighted_replace_pop_and_clear_keep_the_total_weight():
    lru: BoundedLRU[str, str] = BoundedLRU(10, weigh=len)
    lru.put("a", "xxx")
    lru.put("a", "xxxxx")
    assert lru.size == 5
    assert (lru.pop("a"), lru.size) == ("xxxxx", 0)
    lru.put("b", "xx")
    lru.clear()
    assert (len(lru), lru.size) == (0, 0)


def test_a_value_heavier_than_the_capacity_is_not_kept_nor_is_the_old_one():
    lru: BoundedLRU[str, str] = BoundedLRU(3, weigh=len)
    lru.put("keep", "x")
    lru.put("a", "xx")
    lru.put("a", "xxxx")
    assert (list(lru), lru.get("a"), lru.size, lru.evictions) == (["keep"], None, 1, 0)


def test_replace_keeps_a_keys_recency_and_an_absent_key_absent():
    lru: BoundedLRU[str, str] = BoundedLRU(3)
    lru.put("a", "1")
    lru.put("b", "2")
    lru.replace("a", "one")
    lru.replace("z", "26")
    assert (list(lru), lru.get("a"), "z" in lru) == (["a", "b"], "one", False)
    lru.put("c", "3")
    lru.put("d", "4")  # "a" is still the oldest: it goes
    assert list(lru) == ["b", "c", "d"]


def test_a_heavier_replacement_evicts_the_oldest_until_the_weight_fits():
    lru: BoundedLRU[str, str] = BoundedLRU(6, weigh=len)
    lru.put("a", "xx")
    lru.put("b", "xx")
    lru.replace("b", "xxxxx")
    assert (list(lru), lru.size, lru.evictions) == (["b"], 5, 1)
