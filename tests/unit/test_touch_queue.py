"""Queued LRU touches leave the order touching at once would have left."""

from __future__ import annotations

from collections import OrderedDict

from kvindex.touch_queue import TouchQueue


def _lru(keys: str) -> OrderedDict[int, None]:
    return OrderedDict((ord(k), None) for k in keys)


def _order(lru: OrderedDict[int, None]) -> str:
    return "".join(chr(k) for k in lru)


def _walk(keys: str) -> tuple[int, ...]:
    return tuple(ord(k) for k in keys)


def test_applied_touches_give_each_key_the_place_of_its_last_touch() -> None:
    lru = _lru("abcdef")
    queue = TouchQueue(lru)

    queue.defer(_walk("ab"))
    queue.defer(_walk("ca"))
    assert _order(lru) == "abcdef"  # nothing moves until applied

    queue.apply()

    assert _order(lru) == "defbca"  # b, then c, then a: each at its last touch
    assert queue.keys == 0


def test_a_walk_repeated_before_the_next_write_is_queued_once() -> None:
    queue = TouchQueue(_lru("abcd"))

    queue.defer(_walk("ab"))
    queue.defer(_walk("cd"))
    queue.defer(_walk("ab"))

    assert queue.keys == 4


def test_a_walk_that_prefixes_the_next_writes_keys_is_not_replayed() -> None:
    lru = _lru("abcdef")
    queue = TouchQueue(lru)
    queue.defer(_walk("e"))
    queue.defer(_walk("ab"))

    queue.apply(then=_walk("abz"))  # the write touches a, b (and adds z) next

    assert _order(lru) == "abcdfe"  # e was replayed; a and b are left to the write


def test_a_walk_that_is_not_a_prefix_of_the_next_writes_keys_is_replayed() -> None:
    lru = _lru("abcdef")
    queue = TouchQueue(lru)
    queue.defer(_walk("ab"))

    queue.apply(then=_walk("ba"))

    assert _order(lru) == "cdefab"


def test_keys_dropped_since_their_walk_are_skipped() -> None:
    lru = _lru("abcd")
    queue = TouchQueue(lru)
    queue.defer(_walk("abc"))
    del lru[ord("b")]

    queue.apply()

    assert _order(lru) == "dac"


def test_more_queued_keys_than_the_capacity_are_applied_at_once() -> None:
    lru = _lru("abcdef")
    queue = TouchQueue(lru, capacity=3)

    queue.defer(_walk("ab"))
    assert _order(lru) == "abcdef"
    queue.defer(_walk("cd"))

    assert (_order(lru), queue.keys) == ("efabcd", 0)
