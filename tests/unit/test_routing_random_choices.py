"""``random`` and ``power-of-two``: the peers' load-only policies, by name and by what
they choose."""

from __future__ import annotations

from collections import Counter

from routing.strategy_registry import build_strategy, canonical_name
from routing.types import PodView, RouteRequest

REQ = RouteRequest(model="m")


def _counts(name: str, pods: list[PodView], n: int = 4000, seed: int = 7) -> Counter[str]:
    strategy = build_strategy(name, {"seed": seed})
    return Counter(strategy.choose(REQ, pods, None, 0.0).pod for _ in range(n))


def test_the_peers_spellings_resolve():
    assert canonical_name("power_of_two") == "power-of-two"
    assert canonical_name("p2c") == "power-of-two"
    assert canonical_name("random") == "random"


def test_random_spreads_evenly_whatever_the_load():
    pods = [PodView("a", in_flight=50), PodView("b"), PodView("c"), PodView("d")]
    counts = _counts("random", pods)
    assert set(counts) == {"a", "b", "c", "d"}
    assert all(900 < c < 1100 for c in counts.values())  # 1,000 each expected; sd ~27


def test_power_of_two_never_sends_to_the_most_loaded_of_any_pair():
    # Loads 0 < 1 < 2 < 3: a pod wins only against busier ones, so the busiest never
    # wins, and the idle pod wins every pair it is drawn into (half the draws of 4 pods).
    pods = [PodView(name, in_flight=load) for name, load in zip("abcd", (3, 2, 1, 0), strict=True)]
    counts = _counts("power-of-two", pods)
    assert "a" not in counts
    assert 1850 < counts["d"] < 2150  # P(d drawn) = 1/2: 2,000 of 4,000; sd ~32
    assert counts["d"] > counts["c"] > counts["b"] > 0  # 1/2, 1/3, 1/6 of the draws


def test_power_of_two_compares_the_engine_queue_when_in_flight_ties():
    pods = [PodView("a", waiting=5), PodView("b", running=1)]
    assert _counts("power-of-two", pods, n=50) == Counter({"b": 50})


def test_both_draw_the_same_pods_from_the_same_seed_and_a_single_pod_is_chosen():
    pods = [PodView(name) for name in "abcdef"]
    for name in ("random", "power-of-two"):
        first = [build_strategy(name, {"seed": 3}).choose(REQ, pods, None, 0.0).pod]
        assert first == [build_strategy(name, {"seed": 3}).choose(REQ, pods, None, 0.0).pod]
        one = build_strategy(name).choose(REQ, [PodView("only")], None, 0.0)
        assert one.pod == "only"


def test_power_of_two_splits_ties_at_random_not_by_pod_id():
    counts = _counts("power-of-two", [PodView("a"), PodView("b")])
    assert 1850 < counts["a"] < 2150 and counts["a"] + counts["b"] == 4000
