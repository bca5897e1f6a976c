"""Prefix-aware (approximate): longest remembered prefix, gated by match ratio and load."""

import time
from collections import Counter

from routing.load import LoadTracker
from routing.strategies.prefix_aware import PrefixAware
from routing.strategy_registry import build_strategy
from routing.types import PodView, Reason, RouteRequest

PODS = [PodView(p) for p in ("a", "b", "c", "d")]


def _req(hashes):
    return RouteRequest(model="m", prefix_hashes=hashes)


def _pods(**in_flight):
    return [PodView(p.id, in_flight=in_flight.get(p.id, 0)) for p in PODS]


def test_registry_accepts_hyperpod_and_sglang_names():
    for name in ("prefix-aware", "prefixaware", "prefix", "cache-aware", "cache_aware"):
        assert isinstance(build_strategy(name, {"capacity": 10}), PrefixAware)


def test_a_new_prompt_goes_least_loaded_and_its_repeat_follows_it():
    s = PrefixAware()
    first = s.choose(_req([1, 2, 3]), _pods(a=1), None, 0.0)
    assert (first.pod, first.reason) == ("b", Reason.LEAST_LOADED)
    # b is now busier than c and d, but holds the prefix.
    again = s.choose(_req([1, 2, 3]), _pods(a=1, b=2), None, 0.0)
    assert (again.pod, again.reason, again.scores) == ("b", Reason.CACHE_HIT, {"b": 1.0})


def test_the_pod_with_the_longest_remembered_prefix_wins_even_if_busier():
    s = PrefixAware(match_threshold=0.6)
    s.choose(_req([1, 2]), _pods(), None, 0.0)  # -> a
    s.choose(_req([1, 2, 3, 4]), _pods(a=1), None, 0.0)  # 2/4 < 0.6 -> b, holds 1..4
    d = s.choose(_req([1, 2, 3, 4, 5]), _pods(b=3), None, 0.0)
    assert (d.pod, d.reason, d.scores) == ("b", Reason.CACHE_HIT, {"a": 0.4, "b": 0.8})


def test_among_pods_with_the_same_prefix_the_less_loaded_wins():
    s = PrefixAware(balance_abs_threshold=0, balance_rel_threshold=1.0)
    s.choose(_req([1, 2]), _pods(), None, 0.0)  # -> a
    s.choose(_req([1, 2]), _pods(a=1), None, 0.0)  # a overloaded (gap 1 > 0) -> b
    d = s.choose(_req([1, 2, 3]), _pods(a=2, b=1, c=1, d=1), None, 0.0)
    assert (d.pod, d.reason, d.scores) == ("b", Reason.CACHE_HIT, {"a": 2 / 3, "b": 2 / 3})


def test_a_match_below_the_threshold_goes_least_loaded():
    s = PrefixAware(match_threshold=0.5)
    s.choose(_req([1, 2]), _pods(), None, 0.0)  # -> a
    d = s.choose(_req([1, 2, 3, 4, 5]), _pods(a=1), None, 0.0)  # 2/5 < 0.5
    assert (d.pod, d.reason) == ("b", Reason.LEAST_LOADED)
    d = s.choose(_req([1, 2, 3]), _pods(a=1), None, 0.0)  # 2/3: a and b hold it now
    assert (d.pod, d.reason) == ("b", Reason.CACHE_HIT)


def test_an_overloaded_holder_spills_to_the_least_loaded_pod():
    s = PrefixAware(balance_abs_threshold=4, balance_rel_threshold=1.5)
    s.choose(_req([7, 8]), _pods(), None, 0.0)  # -> a
    assert s.choose(_req([7, 8]), _pods(a=5, b=1, c=1, d=1), None, 0.0).pod == "a"  # gap 4
    d = s.choose(_req([7, 8]), _pods(a=6, b=1, c=1, d=1), None, 0.0)
    assert (d.pod, d.reason) == ("b", Reason.LOAD_SPILL)


def test_a_request_without_hashes_falls_back_to_least_loaded():
    d = PrefixAware().choose(_req([]), _pods(a=2, b=1), None, 0.0)
    assert (d.pod, d.reason) == ("c", Reason.FALLBACK)


def test_a_pod_that_left_is_not_chosen_for_its_remembered_prefix():
    s = PrefixAware()
    s.choose(_req([1, 2, 3]), _pods(), None, 0.0)  # -> a
    d = s.choose(_req([1, 2, 3]), [PodView("b", in_flight=3), PodView("c", in_flight=2)], None, 0)
    assert (d.pod, d.reason) == ("c", Reason.LEAST_LOADED)


def test_eviction_trims_prompts_from_the_tail_so_shared_prefixes_survive():
    s = PrefixAware(capacity=4)
    s.choose(_req([1, 2]), _pods(), None, 0.0)  # -> a
    s.choose(_req([1, 2, 3, 4]), _pods(), None, 0.0)  # -> a; 4 entries
    s.choose(_req([5]), _pods(a=1), None, 0.0)  # -> b; evicts hash 4, the oldest tail
    assert s.remembered == 4
    d = s.choose(_req([1, 2, 3, 4]), _pods(a=1), None, 0.0)
    assert (d.pod, d.scores) == ("a", {"a": 0.75})


def test_a_burst_of_identical_prompts_spreads_once_load_is_counted_at_dispatch():
    s = PrefixAware(balance_abs_threshold=2, balance_rel_threshold=1.5)
    tracker = LoadTracker()
    placed = []
    for _ in range(32):  # none finishes
        pods = [PodView(p.id, in_flight=tracker.get(p.id).in_flight) for p in PODS]
        d = s.choose(_req([11, 12, 13]), pods, None, 0.0)
        tracker.start(d.pod)
        placed.append(d.pod)
    assert placed[:4] == ["a", "a", "a", "b"]  # a until its lead exceeds 2, then spill
    assert Counter(placed) == {"a": 8, "b": 8, "c": 8, "d": 8}


def test_one_million_distinct_prompts_keep_the_map_at_capacity():
    s = PrefixAware(capacity=100_000)
    pods = PODS[:2]
    req = _req(())
    started = time.process_time()
    for i in range(0, 2_000_000, 2):  # precomputed two-chunk prompts, all distinct
        req.prefix_hashes = (i, i + 1)
        s.choose(req, pods, None, 0.0)
    elapsed = time.process_time() - started
    assert s.remembered == 100_000
    assert elapsed < 20, f"1M prefix-aware choices took {elapsed:.1f}s of CPU"
