"""Session affinity: sticky, consistent under pod churn, load-gated, bounded."""

import time
from collections import Counter

from routing.strategies.session import SessionAffinity
from routing.strategy_registry import build_strategy
from routing.types import PodView, Reason, RouteRequest

PODS = [PodView(p) for p in ("a", "b", "c", "d")]
KEYS = [f"user-{i}" for i in range(2000)]


def _req(key):
    return RouteRequest(model="m", session_key=key)


def _homes(strategy, pods, keys=KEYS):
    return {k: strategy.choose(_req(k), pods, None, 0.0).pod for k in keys}


def test_registry_accepts_hyperpod_and_short_names():
    for name in ("session", "sticky", "Session"):
        assert isinstance(build_strategy(name, {"capacity": 10}), SessionAffinity)


def test_a_session_always_returns_to_its_home_whatever_the_candidate_order():
    s = SessionAffinity()
    first = s.choose(_req("alice"), PODS, None, 0.0)
    assert first.reason == Reason.SESSION
    for pods in (PODS[::-1], PODS[1:] + PODS[:1]):
        assert s.choose(_req("alice"), pods, None, 0.0).pod == first.pod
    # A fresh strategy (another gateway replica) agrees without shared state.
    assert SessionAffinity().choose(_req("alice"), PODS[::-1], None, 0.0).pod == first.pod


def test_sessions_spread_over_the_pods():
    counts = Counter(_homes(SessionAffinity(capacity=0), PODS).values())
    assert sorted(counts) == ["a", "b", "c", "d"]
    assert all(400 <= n <= 600 for n in counts.values()), counts


def test_a_pod_leaving_moves_only_its_own_sessions():
    for capacity in (0, 100_000):  # pure rendezvous hashing, and with the session memory
        s = SessionAffinity(capacity=capacity)
        before = _homes(s, PODS)
        after = _homes(s, [p for p in PODS if p.id != "c"])
        moved = {k for k in KEYS if before[k] != after[k]}
        assert moved == {k for k in KEYS if before[k] == "c"}
        assert all(after[k] != "c" for k in moved)


def test_a_pod_joining_moves_no_remembered_session():
    s = SessionAffinity()
    before = _homes(s, PODS)
    after = _homes(s, [*PODS, PodView("e")])
    assert after == before
    # New sessions do use the new pod.
    fresh = _homes(s, [*PODS, PodView("e")], keys=[f"new-{i}" for i in range(500)])
    assert "e" in fresh.values()


def test_without_memory_a_joining_pod_takes_sessions_only_for_itself():
    s = SessionAffinity(capacity=0)
    before = _homes(s, PODS)
    after = _homes(s, [*PODS, PodView("e")])
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved and all(after[k] == "e" for k in moved)


def test_no_session_key_goes_least_loaded():
    pods = [PodView("a", in_flight=3), PodView("b", in_flight=1), PodView("c", in_flight=1)]
    d = SessionAffinity().choose(RouteRequest(model="m"), pods, None, 0.0)
    assert (d.pod, d.reason) == ("b", Reason.FALLBACK)


def test_an_overloaded_home_spills_to_the_least_loaded_pod_and_the_session_stays_home():
    s = SessionAffinity(balance_abs_threshold=4, balance_rel_threshold=1.5)
    home = s.choose(_req("bob"), PODS, None, 0.0).pod
    others = sorted(p.id for p in PODS if p.id != home)

    def pods(home_load, other_load):
        return [PodView(p.id, in_flight=home_load if p.id == home else other_load) for p in PODS]

    # A gap of 4 is within the absolute threshold: stay home.
    assert s.choose(_req("bob"), pods(5, 1), None, 0.0).pod == home
    # A gap of 5 and 6 > 1.5 x 1: spill to the least loaded (smallest id among equals).
    spilled = s.choose(_req("bob"), pods(6, 1), None, 0.0)
    assert (spilled.pod, spilled.reason) == (others[0], Reason.LOAD_SPILL)
    # A big absolute gap on busy pods within the relative threshold keeps affinity.
    assert s.choose(_req("bob"), pods(30, 25), None, 0.0).pod == home
    # Once load evens out, the session is home again.
    back = s.choose(_req("bob"), pods(1, 1), None, 0.0)
    assert (back.pod, back.reason) == (home, Reason.SESSION)


def test_one_million_sessions_keep_the_memory_at_capacity():
    s = SessionAffinity(capacity=50_000)
    pods = PODS[:2]
    req = RouteRequest(model="m")
    started = time.process_time()
    for i in range(1_000_000):
        req.session_key = str(i)
        s.choose(req, pods, None, 0.0)
    elapsed = time.process_time() - started
    assert s.remembered == 50_000
    assert elapsed < 20, f"1M session choices took {elapsed:.1f}s of CPU"
