"""The routing core: every step around a strategy call, shared by the gateway and the DES.

Per request, whoever serves it (``gateway.router`` live, ``bench.des.sim`` in
simulated time) does the same five things, here and nowhere else:

1. ``request``: build the ``RouteRequest`` with what the model's strategy
   ``needs`` and only that (the caller computes the index answer when
   ``needs_index`` says so: tokenization and a lookup are async and costly live);
2. ``route``: turn the candidates into ``PodView``s (the in-flight load from the
   ``LoadView``: this router's own dispatches by default, fleet-wide when the gateway
   is scaled out; plus the engine gauges the caller last scraped), ask the
   strategy, record the speculative L0 entries it asks for, and count the request's
   load at once with its *uncached* prompt tokens;
3. ``first_token``: the pod finished the prefill; only the decode slot remains;
4. ``finish``: release the load and give the strategy the outcome.

Synchronous on purpose: nothing here waits, so the simulator runs it as is and its
claims about the gateway's decisions hold by construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvindex.types import Bound, PrefixMatch
from routing.load import InFlight, LoadTracker, LoadView
from routing.strategy_set import StrategySet
from routing.types import Decision, Need, Outcome, PodView, RouteRequest, Strategy

# Record keys as speculatively held in L0 by a pod (the index's ``speculate``, TTL
# bound by the caller): the router's own dispatch, visible before the engine's events.
Speculate = Callable[[str, Sequence[int]], None]
# Blocks a pod holds in L0 by its KV events (the index's ``l0_blocks_now``; None: unknown).
Occupancy = Callable[[str], int | None]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A pod's own queue gauges, as last scraped from its ``/metrics``."""

    waiting: int = 0  # vllm:num_requests_waiting
    running: int = 0  # vllm:num_requests_running
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc (0..1)
    # L0 size in blocks: num_gpu_blocks of vllm:cache_config_info, summed over the
    # pod's engines (0: not exported / not scraped yet)
    kv_capacity_blocks: int = 0


IDLE_ENGINE = EngineLoad()


@dataclass(frozen=True, slots=True)
class Candidate:
    """A healthy pod that may take the request, with its scraped engine gauges."""

    pod: str
    engine: EngineLoad = IDLE_ENGINE


@dataclass(frozen=True, slots=True)
class IndexAnswer:
    """What the index says about one prompt: its block keys and who holds them."""

    prompt_tokens: int  # exact, from the engine-faithful tokenization
    block_keys: Sequence[int]
    match: PrefixMatch
    # Seconds the answer took (tokenizing, keying, the store's lookup): part of the
    # request's routing decision, counted in its latency once.
    lookup_s: float = 0.0


@dataclass(slots=True)
class Routed:
    """One request routed to one pod: the decision and the load it holds until finished."""

    request: RouteRequest
    decision: Decision
    strategy: Strategy
    inflight: InFlight
    # Time the request waited for admission before this dispatch: part of the TTFT its
    # client sees, none of the pod's, so the strategy learns from the TTFT without it.
    waited_s: float = 0.0
    # The strategy learnt from this request at its first token (``learns_at_first_token``):
    # its end observes nothing more, unless the engine's counts contradict the predicted
    # ones, and then ``learnt`` (what ``observe`` returned) is revised.
    observed: bool = False
    learnt: object | None = None

    @property
    def pod(self) -> str:
        return self.decision.pod

    def pod_ttft_s(self, ttft_s: float) -> float:
        """The client's TTFT less the admission wait: what the strategy learns from."""
        return max(0.0, ttft_s - self.waited_s)


class RoutingCore:
    """Strategies per model, the load they see, and the steps around ``choose``."""

    def __init__(
        self,
        default: Strategy,
        per_model: Mapping[str, Strategy] | None = None,
        *,
        load: LoadView | None = None,
        speculate: Speculate | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.use_strategies(StrategySet(default, dict(per_model or {})))
        self.load: LoadView = load if load is not None else LoadTracker()
        self._speculate = speculate
        self._occupancy: Occupancy | None = None
        self._clock = clock

    @classmethod
    def from_config(
        cls,
        default: str,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        model_strategies: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> RoutingCore:
        """Build the strategies by (alias) name; options are keyed by canonical name.

        An unknown name or a bad option raises here, at start-up."""
        built = StrategySet.build(default, options, model_strategies)
        core = cls(built.default, built.per_model, **kwargs)
        core.use_strategies(built)  # with the specs: a reload keeps what did not change
        return core

    @property
    def strategy_set(self) -> StrategySet:
        """The strategies in use (a reload builds the next set over this one)."""
        return self._strategies

    def use_strategies(self, strategies: StrategySet) -> None:
        """Route new requests with ``strategies``. The load view stays, so requests in
        flight keep counting; each finishes on (and is observed by) the strategy that
        routed it, which ``Routed`` holds."""
        self._strategies = strategies
        self._default = strategies.default
        self._per_model = strategies.per_model

    def set_load(self, load: LoadView) -> None:
        """Where load is counted and read (a fleet-wide view, once the gateway has one)."""
        self.load = load

    def set_speculation(self, speculate: Speculate | None) -> None:
        """Where speculative L0 entries go (the index, once it exists)."""
        self._speculate = speculate

    def set_occupancy(self, occupancy: Occupancy | None) -> None:
        """Where each pod's L0 occupancy is read (the index, once it exists): with the
        scraped capacity it tells a strategy whether writing a prefix there evicts."""
        self._occupancy = occupancy

    # -- what a model's strategy needs ------------------------------------------------

    def strategy_for(self, model: str) -> Strategy:
        return self._per_model.get(model, self._default)

    def strategies(self) -> list[Strategy]:
        return self._strategies.strategies()

    def needs_index(self, model: str) -> bool:
        """Whether requests for ``model`` are tokenized and looked up in the index."""
        return Need.INDEX in self.strategy_for(model).needs

    def request(
        self,
        model: str,
        *,
        request_id: str = "",
        prompt_tokens: int = 0,
        stream: bool = False,
        index: IndexAnswer | None = None,
        prefix_hashes: Callable[[], Sequence[int]] | None = None,
        session_key: Callable[[], str | None] | None = None,
    ) -> RouteRequest:
        """The ``RouteRequest`` for ``model``'s strategy, holding only what it needs.

        ``prompt_tokens`` is the caller's estimate; an ``index`` answer replaces it
        with the exact count. ``prefix_hashes`` and ``session_key`` are called only
        when the strategy needs them."""
        needs = self.strategy_for(model).needs
        req = RouteRequest(model=model, request_id=request_id, prompt_tokens=prompt_tokens,
                           stream=stream)  # fmt: skip
        if index is not None and Need.INDEX in needs:
            req.prompt_tokens = index.prompt_tokens
            req.block_keys = index.block_keys
        if prefix_hashes is not None and Need.PREFIX_HASHES in needs:
            req.prefix_hashes = prefix_hashes()
        if session_key is not None and Need.SESSION in needs:
            req.session_key = session_key()
        return req

    def forget_pod(self, pod: str) -> None:
        """``pod`` left the fleet (discovery removed it): its load counts and what each
        strategy learnt about it go."""
        self.load.forget(pod)
        for strategy in self.strategies():
            strategy.forget_pod(pod)

    def bounds(self) -> dict[str, Bound]:
        """Every bounded memory of the strategies, and the load tracker's pods."""
        out = {"load.pods": self.load.bound()}
        for strategy in self.strategies():
            for name, bound in strategy.bounds().items():
                out[f"{strategy.name}.{name}"] = bound
        return out

    # -- one routing ----------------------------------------------------------------------

    def views(self, candidates: Iterable[Candidate]) -> list[PodView]:
        """Routing-time snapshots: the load view's counts plus the scraped engine gauges."""
        views = []
        occupancy = self._occupancy
        for c in candidates:
            load, engine = self.load.get(c.pod), c.engine
            held = None  # read only where it means something: with a known L0 size
            if occupancy is not None and engine.kv_capacity_blocks > 0:
                held = occupancy(c.pod)
            views.append(
                PodView(
                    id=c.pod,
                    in_flight=load.in_flight,
                    in_flight_prefill_tokens=load.prefill_tokens,
                    waiting=engine.waiting,
                    running=engine.running,
                    kv_usage=engine.kv_usage,
                    prefilling=load.prefilling,
                    kv_capacity_blocks=engine.kv_capacity_blocks,
                    kv_held_blocks=held,
                )
            )
        return views

    def route(
        self, req: RouteRequest, candidates: Sequence[Candidate], match: PrefixMatch | None
    ) -> Routed:
        """Choose a pod, record speculation, count the load now (before any await)."""
        return self.commit(req, self.decide(req, candidates, match), match)

    def decide(
        self, req: RouteRequest, candidates: Sequence[Candidate], match: PrefixMatch | None
    ) -> Decision:
        """The strategy's choice, not yet acted on (admission control weighs it first)."""
        return self.strategy_for(req.model).choose(req, self.views(candidates), match,
                                                   self._clock())  # fmt: skip

    def commit(self, req: RouteRequest, decision: Decision, match: PrefixMatch | None) -> Routed:
        """Act on ``decision``: record its speculation and count its load, now."""
        strategy = self.strategy_for(req.model)
        if match is not None and decision.speculate_blocks and self._speculate is not None:
            keys = req.block_keys[: decision.speculate_blocks]
            if keys:
                self._speculate(decision.pod, keys)
        prefill = max(0, req.prompt_tokens - decision.predicted_cached_tokens)
        return Routed(req, decision, strategy, self.load.start(decision.pod, prefill))

    @staticmethod
    def first_token(routed: Routed, ttft_s: float | None = None) -> None:
        """The pod sent the first token: the request's prefill share of the load ends.

        Given the TTFT, a strategy that ``learns_at_first_token`` observes the request
        now, with the prompt's counts its decision predicted (the engine reports its
        cached count only in the usage at the stream's end), and not again at the end.
        Only prompts the gateway tokenized (block keys): one it could not (an image, say:
        its length is an estimate) waits for the engine's counts at the end."""
        routed.inflight.first_token()
        if ttft_s is not None:
            RoutingCore.learn_at_first_token(routed, ttft_s)

    @staticmethod
    def learn_at_first_token(routed: Routed, ttft_s: float) -> None:
        """``first_token``'s learning alone: the gateway calls it once the first byte
        is on its way to the client, since a refit (~0.7 ms every 8th request; 34-48 us a
        request on average, docs/real-engines.md) would delay that byte."""
        strategy = routed.strategy
        if (
            routed.observed
            or routed.inflight.finished
            or not strategy.learns_at_first_token
            or not routed.request.block_keys
        ):
            return
        routed.observed = True
        outcome = Outcome(True, routed.pod_ttft_s(ttft_s))
        routed.learnt = strategy.observe(routed.request, routed.decision, outcome)

    @staticmethod
    def finish(routed: Routed, outcome: Outcome | None) -> None:
        """Release the request's load and, given an outcome, observe it; only the
        first call counts (a stream's end and its client's leaving may both finish it).

        ``None``: the attempt ended without an outcome worth learning from (it is
        being retried on another pod). A request learnt at its first token is revised
        if the engine's cached count is not the one its decision predicted: the index
        was stale, and the point learnt then split the TTFT wrongly."""
        if routed.inflight.finished:
            return
        routed.inflight.finish()
        if outcome is None:
            return
        if routed.waited_s and outcome.ttft_s is not None:
            outcome = replace(outcome, ttft_s=routed.pod_ttft_s(outcome.ttft_s))
        if not routed.observed:
            routed.strategy.observe(routed.request, routed.decision, outcome)
        elif (
            routed.learnt is not None
            and outcome.ok
            and outcome.ttft_s is not None
            and outcome.cached_tokens is not None
            and outcome.cached_tokens != routed.decision.predicted_cached_tokens
        ):
            routed.strategy.revise(routed.request, routed.decision, routed.learnt, outcome)
