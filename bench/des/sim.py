"""The fleet in simulated time: a heap of timed events, the router, the pods.

Routing is the live gateway's own code, minus the network: ``routing.core.RoutingCore``
builds the ``RouteRequest``, the ``PodView``s (load counted at dispatch, prefill share
released at the first token, the rest at the end, plus pod queue state scraped at
most every ``scrape_interval_s`` as the gateway scrapes ``/metrics``), calls the
strategy, records speculative L0 entries and observes the outcome. The index is a
``kvindex`` ``MemoryStore`` fed by the pods' stored and evicted blocks (after
``event_delay_s``), looked up here and passed in, as the gateway passes its lookup.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bench.des.admission import DesAdmission
from bench.des.pod import DesPod, Job
from bench.des.types import DesPodSpec, DesRequest, DesResult
from bench.podmodel import MemoryL2
from bench.profiles import Profile, get_profile
from kvindex.memory_store import MemoryStore
from kvindex.store import IndexOp
from routing.admission import AdmissionPolicy
from routing.core import Candidate, EngineLoad, IndexAnswer, Routed, RoutingCore
from routing.strategy_registry import canonical_name
from routing.types import Outcome, RouteRequest

Progress = Callable[[int], None]  # called with the number of requests finished so far


class FleetSim:
    """One strategy, ``n_pods`` pods of one spec (each slowed by its ``pod_slowdowns``
    factor, when given), one simulated clock."""

    def __init__(
        self,
        n_pods: int,
        strategy: str,
        spec: DesPodSpec,
        *,
        strategy_options: Mapping[str, Any] | None = None,
        model: str = "des-model",
        event_delay_s: float = 0.0,
        scrape_interval_s: float = 2.0,
        speculative_ttl_s: float = 3.0,
        index_capacity: int = 2_000_000,
        admission: AdmissionPolicy | None = None,
        seed: int = 0,
        pod_slowdowns: Sequence[float] = (),
    ) -> None:
        if n_pods <= 0:
            raise ValueError("n_pods must be positive")
        self.now = 0.0
        self.spec = spec
        self.model = model
        self.event_delay_s = event_delay_s
        self.scrape_interval_s = scrape_interval_s
        self.speculative_ttl_s = speculative_ttl_s
        self.strategy_name = canonical_name(strategy)
        self.store = MemoryStore(index_capacity, clock=lambda: self.now)
        self.core = RoutingCore.from_config(
            strategy,
            {self.strategy_name: strategy_options} if strategy_options else None,
            speculate=(
                (lambda pod, keys: self.store.speculate_now(pod, keys, speculative_ttl_s))
                if speculative_ttl_s > 0
                else None
            ),
            clock=lambda: self.now,
        )
        self.core.set_occupancy(self.store.l0_blocks_now)
        self.strategy = self.core.strategy_for(model)
        self.l2 = MemoryL2(spec.l2_capacity_blocks) if spec.l2_capacity_blocks > 0 else None
        self.pods = [
            DesPod(f"pod-{i}", pod_spec, self.l2, self._at, self._publish, self._finished,
                   self._first_token, seed=seed)
            for i, pod_spec in enumerate(slowed_specs(spec, n_pods, pod_slowdowns))
        ]  # fmt: skip
        self._by_name = {p.name: p for p in self.pods}
        self._scraped: dict[str, EngineLoad] = {p.name: EngineLoad() for p in self.pods}
        self._scraped_at = -1e18
        self._heap: list[tuple[float, int, Callable[[Any, float], None], Any]] = []
        self._seq = 0
        self.results: list[DesResult] = []
        self.finished = 0
        self._on_finish: Callable[[Job, float], None] | None = None
        self.admission = DesAdmission(self, admission) if admission is not None else None

    # -- event loop -------------------------------------------------------------

    def _at(self, when: float, fn: Callable[[Any, float], None], arg: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, arg))

    def _loop(self, progress: Progress | None, every: int = 500) -> None:
        heap, pop = self._heap, heapq.heappop
        reported = 0
        while heap:
            when, _, fn, arg = pop(heap)
            self.now = when
            fn(arg, when)
            if progress is not None and self.finished - reported >= every:
                reported = self.finished
                progress(reported)
        if progress is not None:
            progress(self.finished)

    # -- index ----------------------------------------------------------------------

    def _publish(self, pod: str, ops: list[IndexOp]) -> None:
        if self.event_delay_s <= 0:
            self.store.apply_now(pod, ops)
        else:
            self._at(self.now + self.event_delay_s, self._apply, (pod, ops))

    def _apply(self, arg: tuple[str, list[IndexOp]], now: float) -> None:
        self.store.apply_now(*arg)

    # -- routing ----------------------------------------------------------------------

    def _candidates(self, now: float) -> list[Candidate]:
        if now - self._scraped_at >= self.scrape_interval_s:
            self._scraped_at = now
            for p in self.pods:
                self._scraped[p.name] = EngineLoad(
                    len(p.waiting), p.running, p.kv_usage(), p.spec.l0_capacity_blocks
                )
        return [Candidate(p.name, self._scraped[p.name]) for p in self.pods]

    def dispatch(self, index: int, req: DesRequest, now: float) -> None:
        """Route one arriving request and hand it to the chosen pod (or to admission
        control, which dispatches it through ``submit`` when it may go)."""
        route, answer = self.prepare(index, req)
        if self.admission is not None:
            self.admission.arrive(index, req, route, answer, now)
            return
        routed = self.core.route(route, self._candidates(now), answer.match if answer else None)
        self.submit(index, req, routed, now)

    def prepare(self, index: int, req: DesRequest) -> tuple[RouteRequest, IndexAnswer | None]:
        """What the gateway's ``Router.prepare`` builds: the request and the index answer."""
        core, bs = self.core, self.spec.block_size
        keys = req.block_keys[: req.prompt_tokens // bs]
        answer = None
        if core.needs_index(self.model):
            answer = IndexAnswer(req.prompt_tokens, keys, self.store.match_now(keys, bs))
        route = core.request(
            self.model,
            request_id=str(index),
            prompt_tokens=req.prompt_tokens,
            index=answer,
            prefix_hashes=lambda: keys,
            session_key=lambda: req.session,
        )
        return route, answer

    def submit(self, index: int, req: DesRequest, routed: Routed, now: float) -> None:
        """Hand a routed request (its load counted) to its pod."""
        decision = routed.decision
        result = DesResult(
            index=index,
            pod=decision.pod,
            arrival_s=req.arrival_s,
            prompt_tokens=req.prompt_tokens,
            output_tokens=req.output_tokens,
            predicted_cached_tokens=decision.predicted_cached_tokens,
            predicted_ttft_s=decision.predicted_ttft_s,
            reason=decision.reason,
            priority=req.priority,
            tenant=req.tenant,
            gateway_wait_s=routed.waited_s,
        )
        self.results.append(result)
        self._by_name[decision.pod].submit(Job(req, result, routed), now)

    def shed(self, index: int, req: DesRequest, reason: str, now: float) -> None:
        """Admission control answered 429: the request never reaches a pod."""
        self.results.append(
            DesResult(index=index, pod="", arrival_s=req.arrival_s, prompt_tokens=req.prompt_tokens,
                      output_tokens=req.output_tokens, priority=req.priority, tenant=req.tenant,
                      shed=reason, gateway_wait_s=now - req.arrival_s)
        )  # fmt: skip
        self._request_done(now)

    # Admission hears of load changes in an event of their own at the same instant, so a
    # waiter it dispatches never enters a pod in the middle of that pod's own step.
    def _first_token(self, job: Job, now: float) -> None:
        if self.admission is not None:
            self._at(now, self.admission.load_changed, False)

    def _finished(self, job: Job, now: float) -> None:
        r = job.result
        self.core.finish(job.routed, Outcome(True, r.ttft_s, r.prompt_tokens, r.cached_tokens))
        self.finished += 1
        if self.admission is not None:
            self._at(now, self.admission.load_changed, True)
        if self._on_finish is not None:
            self._on_finish(job, now)

    def _request_done(self, now: float) -> None:
        self.finished += 1

    # -- workloads ----------------------------------------------------------------------

    def run_open(self, requests: Sequence[DesRequest], progress: Progress | None = None) -> None:
        """Each request arrives at its ``arrival_s`` regardless of the others."""
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)

        def arrive(pos: int, now: float) -> None:
            i = order[pos]
            self.dispatch(i, requests[i], now)
            if pos + 1 < len(order):
                nxt = order[pos + 1]
                self._at(requests[nxt].arrival_s, arrive, pos + 1)

        if order:
            self._at(requests[order[0]].arrival_s, arrive, 0)
        self._loop(progress)

    def run_closed(
        self,
        sessions: Sequence[Sequence[DesRequest]],
        concurrency: int,
        progress: Progress | None = None,
    ) -> None:
        """Like ``bench.loadgen.run_closed_loop``: ``concurrency`` users take sessions
        in order; each sends a session's requests one after another (``arrival_s``
        ignored: a request arrives when the user's previous one finished). Not with
        admission control: a shed request would leave its user waiting forever."""
        if self.admission is not None:
            raise ValueError("admission control needs an open-loop workload")
        queue = list(range(len(sessions)))[::-1]
        position: dict[int, tuple[int, int]] = {}  # request index -> (session, turn)

        def send(session: int, turn: int, now: float) -> None:
            req = sessions[session][turn]
            index = len(self.results)
            position[index] = (session, turn)
            timed = dataclasses.replace(req, arrival_s=now)
            self.dispatch(index, timed, now)

        def next_session(now: float) -> None:
            while queue:
                s = queue.pop()
                if sessions[s]:
                    send(s, 0, now)
                    return

        def on_finish(job: Job, now: float) -> None:
            session, turn = position.pop(job.result.index)
            if turn + 1 < len(sessions[session]):
                send(session, turn + 1, now)
            else:
                next_session(now)

        self._on_finish = on_finish
        for _ in range(max(1, concurrency)):
            self._at(0.0, lambda _arg, now: next_session(now), None)
        self._loop(progress)


def slowed_specs(spec: DesPodSpec, n_pods: int, slowdowns: Sequence[float]) -> list[DesPodSpec]:
    """Each pod's spec: pod i's compute ``slowdowns[i % len(slowdowns)]`` times as long
    as ``spec``'s (all alike when ``slowdowns`` is empty)."""
    if not slowdowns:
        return [spec] * n_pods
    factors = [slowdowns[i % len(slowdowns)] for i in range(n_pods)]
    return [
        spec if f == 1 else dataclasses.replace(spec, timing=spec.timing.slowed(f)) for f in factors
    ]


def resolve_spec(profile: Profile | DesPodSpec | str, tiers: str, block_size: int) -> DesPodSpec:
    if isinstance(profile, DesPodSpec):
        return profile
    if isinstance(profile, str):
        profile = get_profile(profile)
    return DesPodSpec.from_profile(profile, block_size, tiers)


def run_des(
    workload_requests: Sequence[DesRequest] | Sequence[Sequence[DesRequest]],
    n_pods: int,
    strategy: str,
    profile: Profile | DesPodSpec | str = "original",
    tiers: str = "L0+L1+L2",
    *,
    block_size: int = 16,
    concurrency: int | None = None,
    strategy_options: Mapping[str, Any] | None = None,
    event_delay_s: float = 0.0,
    scrape_interval_s: float = 2.0,
    speculative_ttl_s: float = 3.0,
    progress: Progress | None = None,
    seed: int = 0,
    pod_slowdowns: Sequence[float] = (),
) -> list[DesResult]:
    """Simulate ``workload_requests`` on ``n_pods`` pods routed by ``strategy``.

    Open loop (requests arrive at ``arrival_s``) unless ``concurrency`` is given, in
    which case ``workload_requests`` is a list of sessions replayed closed-loop. A
    ``DesPodSpec`` as ``profile`` fixes every pod setting (``tiers`` and
    ``block_size`` are then ignored). ``kv-aware`` gets the profile's cost model
    unless ``strategy_options`` say otherwise. ``seed`` seeds what the pods draw at
    random (``PodTiming.step_phase_wait``). ``pod_slowdowns``: each pod's compute time
    as a multiple of the spec's, repeated over the pods (``slowed_specs``). Results
    are in request order.
    """
    spec = resolve_spec(profile, tiers, block_size)
    options = dict(strategy_options or {})
    if (
        not options
        and canonical_name(strategy) == "kv-aware"
        and not isinstance(profile, DesPodSpec)
    ):
        prof = get_profile(profile) if isinstance(profile, str) else profile
        options = {"cost_model": prof.cost_model(spec.block_size)}
    sim = FleetSim(
        n_pods,
        strategy,
        spec,
        strategy_options=options,
        event_delay_s=event_delay_s,
        scrape_interval_s=scrape_interval_s,
        speculative_ttl_s=speculative_ttl_s,
        seed=seed,
        pod_slowdowns=pod_slowdowns,
    )
    if concurrency is None:
        sim.run_open(workload_requests, progress)  # type: ignore[arg-type]
    else:
        sim.run_closed(workload_requests, concurrency, progress)  # type: ignore[arg-type]
    return sorted(sim.results, key=lambda r: r.index)
