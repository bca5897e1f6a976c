"""The routing core: one piece of code around every strategy call, for gateway and DES."""

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from bench.des.sim import FleetSim
from bench.des.types import DesPodSpec, DesRequest
from bench.podmodel import PodTiming, TierTiming
from gateway.config import ModelSettings, PodConfig, Settings
from gateway.kv import KvIndex
from gateway.metrics import GatewayMetrics
from gateway.openai_body import parse_body
from gateway.pods import Pod
from gateway.router import Router
from kvindex.keyer import BlockKeyer
from kvindex.store import Stored
from kvindex.types import PrefixMatch, Tier
from routing import strategy_registry
from routing.core import Candidate, EngineLoad, IndexAnswer, RoutingCore
from routing.strategy_registry import register
from routing.types import Decision, Need, NoCandidates, Outcome, Reason, RouteRequest, Strategy

MODEL = "parity-model"
BS = 16
PODS = ["pod-0", "pod-1", "pod-2"]
KV_OPTIONS = {
    "cost_model": {"prefill_tokens_per_s": 2000.0, "prefill_overhead_s": 0.05,
                   "block_size": BS},
    "calibrate": False,
}  # fmt: skip


class _Recorder(Strategy):
    """Always the first candidate; remembers what it was shown."""

    needs = frozenset({Need.INDEX, Need.SESSION})

    def __init__(self) -> None:
        self.seen: list[tuple[object, ...]] = []
        self.observed: list[Outcome] = []

    def pick(self, req, pods, match, now) -> Decision:
        self.seen.append((req, list(pods), match, now))
        return Decision(pod=pods[0].id, strategy="recorder", reason=Reason.FALLBACK,
                        predicted_l0_tokens=32, speculate_blocks=2)  # fmt: skip

    def observe(self, req, decision, outcome) -> None:
        self.observed.append(outcome)


# -- the strategy contract ---------------------------------------------------------------


def test_a_misspelt_need_is_an_error_when_the_class_is_defined():
    with pytest.raises(TypeError, match="uses_indx"):

        class Misspelt(Strategy):  # noqa: F841
            uses_indx = True

            def pick(self, req, pods, match, now):
                raise AssertionError


def test_needs_must_be_a_frozenset_of_need():
    with pytest.raises(TypeError, match="frozenset of routing.types.Need"):

        class Stringly(Strategy):  # noqa: F841
            needs = frozenset({"index"})

            def pick(self, req, pods, match, now):
                raise AssertionError


def test_choose_among_no_candidates_raises_for_every_strategy_in_one_place():
    core = RoutingCore(_Recorder())
    with pytest.raises(NoCandidates):
        core.route(core.request(MODEL), [], None)


def test_register_names_the_class_and_refuses_a_taken_name(monkeypatch):
    monkeypatch.setattr(strategy_registry, "_FACTORIES", dict(strategy_registry._FACTORIES))
    monkeypatch.setattr(strategy_registry, "_ALIASES", dict(strategy_registry._ALIASES))

    @register("test-only-first")
    class First(_Recorder):
        pass

    assert First.name == "test-only-first"
    with pytest.raises(ValueError, match="already"):

        @register("test-only-first")
        class Second(_Recorder):
            pass


def test_register_refuses_a_class_that_is_not_a_strategy():
    with pytest.raises(TypeError, match="Strategy subclass"):
        register("test-only-plain")(object)


def test_observe_defaults_to_learning_nothing():
    class Quiet(Strategy):
        def pick(self, req, pods, match, now):
            return Decision(pod=pods[0].id, strategy="quiet", reason=Reason.FALLBACK)

    core = RoutingCore(Quiet())
    routed = core.route(core.request(MODEL), [Candidate("a")], None)
    core.finish(routed, Outcome(ok=True))
    assert core.load.get("a").in_flight == 0


# -- the steps around choose ---------------------------------------------------------------


def test_request_holds_only_what_the_strategy_needs():
    core = RoutingCore.from_config("round-robin")
    asked: list[str] = []
    req = core.request(
        MODEL,
        prompt_tokens=40,
        index=IndexAnswer(100, [1, 2], PrefixMatch.empty(2, BS)),
        prefix_hashes=lambda: asked.append("hashes") or [7],
        session_key=lambda: asked.append("session") or "s",
    )
    assert (req.prompt_tokens, tuple(req.block_keys), req.session_key, asked) == (40, (), None, [])


def test_request_takes_the_exact_length_and_keys_from_the_index_answer():
    core = RoutingCore(_Recorder())
    answer = IndexAnswer(100, [1, 2, 3], PrefixMatch.empty(3, BS))
    req = core.request(MODEL, prompt_tokens=40, index=answer, session_key=lambda: "s-1")
    assert (req.prompt_tokens, list(req.block_keys), req.session_key) == (100, [1, 2, 3], "s-1")


def _speculating_core() -> tuple[_Recorder, RoutingCore, list, IndexAnswer, RouteRequest]:
    """A core that records its speculation, and a 100-token request with 3 block keys."""
    recorder = _Recorder()
    speculated: list[tuple[str, list[int]]] = []
    core = RoutingCore(recorder, speculate=lambda pod, keys: speculated.append((pod, list(keys))))
    answer = IndexAnswer(100, [11, 12, 13], PrefixMatch.empty(3, BS))
    return recorder, core, speculated, answer, core.request(MODEL, index=answer)


def test_route_counts_uncached_tokens_at_once_speculates_and_finish_observes_once():
    recorder, core, speculated, answer, req = _speculating_core()
    routed = core.route(req, [Candidate("a", EngineLoad(waiting=2)), Candidate("b")], answer.match)
    load = core.load.get("a")
    assert (load.in_flight, load.prefill_tokens, load.prefilling) == (1, 100 - 32, 1)
    assert speculated == [("a", [11, 12])]
    _, views, _, _ = recorder.seen[0]
    assert [(v.id, v.waiting) for v in views] == [("a", 2), ("b", 0)]
    core.first_token(routed)
    assert (load.prefill_tokens, load.prefilling) == (0, 0)
    core.finish(routed, Outcome(ok=True, ttft_s=0.1))
    core.finish(routed, Outcome(ok=False))  # the stream's end and its client's leaving
    assert (core.load.get("a").in_flight, len(recorder.observed)) == (0, 1)


def test_views_give_each_pod_its_scraped_l0_size_and_the_index_occupancy():
    recorder = _Recorder()
    core = RoutingCore(recorder)
    held = {"a": 700, "b": 1200, "d": 5}  # d: held, but its size unknown
    core.set_occupancy(held.get)
    candidates = [
        Candidate("a", EngineLoad(kv_capacity_blocks=1000)),
        Candidate("b", EngineLoad(kv_capacity_blocks=1000)),
        Candidate("c", EngineLoad(kv_capacity_blocks=1000)),  # the index does not know c
        Candidate("d"),  # no capacity scraped
    ]
    core.route(core.request(MODEL), candidates, None)
    _, views, _, _ = recorder.seen[-1]
    assert [(v.kv_capacity_blocks, v.kv_held_blocks) for v in views] == [
        (1000, 700), (1000, 1200), (1000, None), (0, None)]  # fmt: skip
    core.set_occupancy(None)  # no index: nothing is known
    core.route(core.request(MODEL), candidates, None)
    assert [v.kv_held_blocks for v in recorder.seen[-1][1]] == [None] * 4


def test_a_retried_attempt_releases_its_load_without_teaching_the_strategy():
    recorder = _Recorder()
    core = RoutingCore(recorder)
    routed = core.route(core.request(MODEL), [Candidate("a")], None)
    core.finish(routed, None)
    assert (core.load.get("a").in_flight, recorder.observed) == (0, [])


def test_decide_counts_nothing_until_commit_and_commit_acts_like_route():
    _, core, speculated, answer, req = _speculating_core()
    decision = core.decide(req, [Candidate("a"), Candidate("b")], answer.match)
    assert (decision.pod, core.load.get("a").in_flight, speculated) == ("a", 0, [])
    routed = core.commit(req, decision, answer.match)
    assert (routed.pod, core.load.get("a").prefill_tokens, speculated) == (
        "a",
        68,
        [("a", [11, 12])],
    )


def test_the_strategy_learns_the_ttft_after_the_wait_for_admission():
    recorder = _Recorder()
    core = RoutingCore(recorder)
    routed = core.route(core.request(MODEL), [Candidate("a")], None)
    routed.waited_s = 1.5  # the client saw 1.75 s, the pod took 0.25 s of it
    core.finish(routed, Outcome(ok=True, ttft_s=1.75, prompt_tokens=10))
    assert recorder.observed == [Outcome(ok=True, ttft_s=0.25, prompt_tokens=10)]


class _EarlyLearner(_Recorder):
    learns_at_first_token = True


def test_a_strategy_that_learns_at_the_first_token_observes_then_and_not_at_the_end():
    learner = _EarlyLearner()
    core = RoutingCore(learner)
    answer = IndexAnswer(100, [11, 12, 13], PrefixMatch.empty(3, BS))
    routed = core.route(core.request(MODEL, index=answer), [Candidate("a")], answer.match)
    routed.waited_s = 0.5
    core.first_token(routed, 0.75)
    # The TTFT without the admission wait, and no counts: the decision's are taken.
    assert learner.observed == [Outcome(ok=True, ttft_s=0.25)]
    core.first_token(routed, 0.8)  # a second call teaches nothing more
    core.finish(routed, Outcome(ok=True, ttft_s=0.75, prompt_tokens=100, cached_tokens=32))
    assert (len(learner.observed), core.load.get("a").in_flight) == (1, 0)


def test_learning_after_the_first_byte_does_not_observe_a_request_its_end_observed():
    # The gateway learns once the first byte is on its way; a request that ended in
    # between (its client left) was observed at its end, and only there.
    learner = _EarlyLearner()
    core = RoutingCore(learner)
    answer = IndexAnswer(100, [11], PrefixMatch.empty(1, BS))
    routed = core.route(core.request(MODEL, index=answer), [Candidate("a")], answer.match)
    core.first_token(routed)
    core.finish(routed, Outcome(ok=True, ttft_s=0.2, prompt_tokens=100, cached_tokens=0))
    core.learn_at_first_token(routed, 0.2)
    assert learner.observed == [Outcome(ok=True, ttft_s=0.2, prompt_tokens=100, cached_tokens=0)]


class _Reviser(_EarlyLearner):
    """Learns at the first token, returns a receipt, records what it is asked to revise."""

    def __init__(self) -> None:
        super().__init__()
        self.revised: list[tuple[object, Outcome]] = []

    def observe(self, req, decision, outcome) -> str:
        super().observe(req, decision, outcome)
        return f"point {len(self.observed)}"

    def revise(self, req, decision, learnt, outcome) -> None:
        self.revised.append((learnt, outcome))


def test_the_end_revises_a_first_token_point_only_where_the_engine_counted_otherwise():
    reviser = _Reviser()
    core = RoutingCore(reviser)
    answer = IndexAnswer(100, [11, 12, 13], PrefixMatch.empty(3, BS))
    candidates = [Candidate("a")]
    agreed = core.route(core.request(MODEL, index=answer), candidates, answer.match)
    core.first_token(agreed, 0.2)
    core.finish(agreed, Outcome(ok=True, ttft_s=0.2, prompt_tokens=100, cached_tokens=32))
    assert reviser.revised == []  # the decision predicted 32 cached: the point stands
    stale = core.route(core.request(MODEL, index=answer), candidates, answer.match)
    stale.waited_s = 0.1
    core.first_token(stale, 0.5)
    core.finish(stale, Outcome(ok=True, ttft_s=0.5, prompt_tokens=100, cached_tokens=0))
    assert reviser.revised == [
        ("point 2", Outcome(ok=True, ttft_s=0.4, prompt_tokens=100, cached_tokens=0))
    ]
    assert len(reviser.observed) == 2  # revising is not observing once more


def test_the_first_token_teaches_nothing_without_a_ttft_or_a_counted_prompt():
    learner = _EarlyLearner()
    core = RoutingCore(learner)
    # Not tokenized (an image, say): the length is an estimate, and there are no keys.
    uncounted = core.route(core.request(MODEL, prompt_tokens=40), [Candidate("a")], None)
    assert uncounted.request.prompt_tokens == 40
    core.first_token(uncounted, 0.3)
    assert learner.observed == []
    core.finish(uncounted, Outcome(ok=True, ttft_s=0.3, prompt_tokens=40, cached_tokens=0))
    assert learner.observed == [Outcome(ok=True, ttft_s=0.3, prompt_tokens=40, cached_tokens=0)]
    answer = IndexAnswer(100, [11], PrefixMatch.empty(1, BS))
    counted = core.route(core.request(MODEL, index=answer), [Candidate("a")], answer.match)
    core.first_token(counted)  # a caller with no TTFT: the end teaches
    core.finish(counted, Outcome(ok=True, ttft_s=0.2, prompt_tokens=100))
    assert learner.observed[-1] == Outcome(ok=True, ttft_s=0.2, prompt_tokens=100)


def test_a_strategy_that_learns_at_the_end_is_not_observed_at_the_first_token():
    recorder = _Recorder()
    core = RoutingCore(recorder)
    answer = IndexAnswer(100, [11], PrefixMatch.empty(1, BS))
    routed = core.route(core.request(MODEL, index=answer), [Candidate("a")], answer.match)
    core.first_token(routed, 0.2)
    assert recorder.observed == []
    core.finish(routed, Outcome(ok=True, ttft_s=0.2, prompt_tokens=100, cached_tokens=0))
    assert recorder.observed == [Outcome(ok=True, ttft_s=0.2, prompt_tokens=100, cached_tokens=0)]


# -- gateway and DES decide alike ----------------------------------------------------------


def _burst() -> list[tuple[list[int], str]]:
    """Token-id prompts: three families sharing prefixes, repeated, plus cold ones."""
    prompts = []
    for i in range(24):
        family = i % 3
        shared = [1000 * family + t for t in range(64 + 32 * family)]
        tail = [50_000 + i * 97 + t for t in range(8 + 16 * (i % 5))]
        prompts.append((shared + tail if i % 4 else [7_000 + i * 301 + t for t in range(40)],
                        f"user-{i % 5}"))  # fmt: skip
    return prompts


def _warm_ops(keyer: BlockKeyer) -> dict[str, list[Stored]]:
    """pod-1 holds family 0's shared prefix, pod-2 family 2's (as events said)."""
    fam0 = keyer.keys([t for t in range(64)])
    fam2 = keyer.keys([2000 + t for t in range(128)])
    return {"pod-1": [Stored(Tier.L0, fam0)], "pod-2": [Stored(Tier.L0, fam2[:6])]}


def _des_decisions(strategy: str, options: dict | None) -> list[str]:
    timing = PodTiming(0.05, 2000.0, 1000, TierTiming(0.01, 1e9), TierTiming(0.02, 1e9), 0.02,
                       0.001)  # fmt: skip
    spec = DesPodSpec(timing=timing, block_size=BS, l0_capacity_blocks=10_000)
    sim = FleetSim(len(PODS), strategy, spec, strategy_options=options, model=MODEL)
    keyer = BlockKeyer(MODEL, BS)
    for pod, ops in _warm_ops(keyer).items():
        sim.store.apply_now(pod, ops)
    for i, (tokens, user) in enumerate(_burst()):
        sim.dispatch(i, DesRequest(0.0, len(tokens), 4, keyer.keys(tokens), user), 0.0)
    return [r.pod for r in sim.results]


async def _gateway_decisions(strategy: str, options: dict | None) -> list[str]:
    settings = Settings(
        strategy=strategy,
        strategy_options={strategy: options} if options else {},
        models={MODEL: ModelSettings(block_size=BS)},
    )
    prometheus = CollectorRegistry()
    async with httpx.AsyncClient() as client:
        kv = KvIndex(settings, prometheus, client)
        core = RoutingCore.from_config(settings.strategy, settings.strategy_options,
                                       speculate=kv.speculate)  # fmt: skip
        # gateway.state wires kv.l0_blocks_now, which answers only for pods whose events
        # it follows; here the events are applied to the store directly, so read it.
        core.set_occupancy(kv.store.l0_blocks_now)
        router = Router(core, GatewayMetrics(prometheus), kv)
        for pod, ops in _warm_ops(kv.keyer(MODEL)).items():
            await kv.store.apply(pod, ops)
        scraped = EngineLoad(kv_capacity_blocks=10_000)  # the DES pods' L0 size
        pods = [Pod(PodConfig(name=n, url=f"http://{n}"), healthy=True, models={MODEL},
                    engine=scraped) for n in PODS]  # fmt: skip
        chosen = []
        for i, (tokens, user) in enumerate(_burst()):
            body = {"model": MODEL, "prompt": tokens, "max_tokens": 4, "user": user}
            parsed = parse_body(json.dumps(body).encode(), "completions")
            req, answer = await router.prepare(parsed, MODEL, str(i), {}, pods)
            chosen.append(router.route(req, pods, answer).pod)
        await kv.close()
    return chosen


@pytest.mark.parametrize(
    ("strategy", "options"),
    [("kv-aware", KV_OPTIONS), ("round-robin", None), ("least-loaded", None), ("session", None)],
)
async def test_the_gateway_and_the_des_route_the_same_burst_to_the_same_pods(strategy, options):
    des = _des_decisions(strategy, options)
    live = await _gateway_decisions(strategy, options)
    assert live == des
    assert len(set(des)) > 1  # the burst spreads: the comparison is not trivially one pod


def test_kv_aware_sends_the_burst_where_the_index_says_the_prefixes_are():
    """The parity above is not by chance: warm families go to their holders while
    every cache is priced as full (``roomy_share`` 0) ..."""
    des = _des_decisions("kv-aware", {**KV_OPTIONS, "roomy_share": 0.0})
    assert (des[2], des[3]) == ("pod-2", "pod-1")  # family 2 on pod-2, family 0 on pod-1
    # ... and with room, family 0's prefix is copied to pod-0 (which events show empty)
    # rather than queued behind pod-1's cold family-1 prefill.
    des = _des_decisions("kv-aware", KV_OPTIONS)
    assert (des[1], des[2], des[3]) == ("pod-1", "pod-2", "pod-0")


def test_the_prompt_size_estimate_takes_any_prompt_items():
    """Regression (fuzz): /tokenize with prompt [null] raised in the size estimate."""
    parsed = parse_body(b'{"prompt": [null, "ab", [1, 2], 7]}', "tokenize")
    assert parsed.approx_prompt_chars() == 0 + 2 + 8 + 4


def test_the_decision_histogram_counts_the_index_answers_time_once_per_request():
    """``kvgate_routing_decision_seconds`` is tokenizing, keying and the lookup (timed
    into the ``IndexAnswer``) plus the strategy: the answer's share counts on the
    request's first routing, not again when a retry routes it elsewhere."""
    prometheus = CollectorRegistry()
    core = RoutingCore.from_config("round-robin", {})
    router = Router(core, GatewayMetrics(prometheus))
    pods = [Pod(PodConfig(name=n, url=f"http://{n}"), healthy=True, models={MODEL}) for n in PODS]
    answer = IndexAnswer(100, [1, 2], PrefixMatch.empty(2, BS), lookup_s=0.25)
    req = RouteRequest(MODEL, "r1")

    def observed() -> float:
        return prometheus.get_sample_value(
            "kvgate_routing_decision_seconds_sum", {"strategy": "round-robin"}
        )

    router.finish(router.route(req, pods, answer), None)
    first = observed()
    assert 0.25 <= first < 0.3  # the lookup's quarter second, and a strategy's microseconds
    router.finish(router.route(req, pods, answer, retry=True), None)
    assert observed() - first < 0.05  # the retry: the strategy alone
    decision = router.decide(req, pods, answer)
    router.finish(router.commit(req, decision, answer, took_s=0.001), None)
    assert 0.251 <= observed() - first < 0.3  # admission's commit is a first routing
