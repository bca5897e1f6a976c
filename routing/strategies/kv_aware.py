"""KV-aware (precise): send each request where its predicted TTFT is lowest.

Uses the index's ``PrefixMatch`` (per pod the consecutive prefix in L0 and in L0+L1,
fleet-wide the consecutive prefix in L2) and the ``CostModel``. Per candidate pod:

* cached tokens are capped like vLLM, which always recomputes the last prompt token:
  at most ``(prompt_tokens - 1) // block_size * block_size``;
* L0 tokens are free; the L1 segment (L0+L1 beyond L0) and the L2 segment (the
  fleet's L2 prefix beyond L0+L1) count only where ``CostModel.plan_loads`` says
  loading beats recomputing (the pod would recompute otherwise);
* predicted TTFT = queue delay (load counted at dispatch) + loads + prefill;
* eviction cost = ``eviction_weight`` x what the pod's missing full blocks cost this
  request (their loads and prefill, no fixed overhead): writing them into a full L0
  evicts as many blocks of other prefixes, which their next request fetches again.

The minimum of predicted TTFT + eviction cost wins (``Decision.scores``); ties go to the
less loaded pod, then the smaller id, never to list order. ``predicted_ttft_s`` is the
winner's TTFT alone. ``observe`` feeds each model's ``Calibrator`` with the observed TTFT,
and ``PodSpeeds`` with how much faster or slower than the fitted model each pod was:
each candidate is priced with its own pod's speed (``routing.pod_speed`` has the
measurements that call for it).

It learns at each request's first token (``learn_at_first_token``), when the TTFT is
known, not at the stream's end, when the engine's cached count arrives in the usage:
on a slow pod the end comes long after (real vLLM pods, users at 67% of capacity: one
pod's requests ended ~550 ms after they started, against a TTFT of ~100 ms), and a
Poisson workload routes ~15 more requests on what was known before. The cached count
is then the index's prediction, which matched vLLM's count on every one of 1,800
kv-aware requests of two real-fleet runs (docs/real-engines.md).

Why the eviction cost: ranking by TTFT alone spills a hot prefix to another pod as
soon as the holder's queue exceeds a full prefill elsewhere. Under cache pressure that
duplicates the prefix and evicts other prefixes from the receiving pod, whose next
requests then recompute and queue, which makes the next spill likelier: the tail
varies from seed to seed (``kvgate bench des --preset quick --seeds 0,...,9`` with
``eviction_weight`` 0 shows it; docs/performance.md has the numbers).
With the cost a pod that lacks the prefix must beat the holder by what its write
evicts: for a prefix held in L2 it is an L2 load (spilling stays cheap), without lower
tiers it is a recompute.
Only a cache under pressure evicts: where the pod's L0 size is scraped
(``vllm:cache_config_info``) and the index counts what its events put there
(``PodView.kv_capacity_blocks``, ``kv_held_blocks``), only the blocks that do not fit
evict (``evicted_blocks``). What fits depends on what is written:

* a copy (blocks another pod, L2 or the pod's own L1 holds) fits while the pod stays
  under ``roomy_share`` (a quarter) of its L0, so a fleet with room replicates a hot
  prefix as soon as the holder's queue costs more than the copy's prefill. Why not all
  the free room: a cache under pressure is empty only for its first seconds, and what a
  copy fills then is evicted later all the same; counting that room as free made the
  first placements of ``kvgate bench des --preset quick`` spread prefixes, which the
  fleet paid for through the run (rag L0 TTFT p90 median 90 -> 197 ms over 12 seeds;
  with a quarter, unchanged);
* new blocks (held nowhere) must be written somewhere, so they fit in all the pod's
  free room (less what its prefills in flight will write): a new prompt goes where it
  evicts least, not to the pod whose queue is a few milliseconds shorter. Priced as
  evicting everywhere, a new prefix went by queue alone and could land on a pod whose
  L0 its homed prefixes already filled, evicting them and recomputing through the
  run: DES quick preset, 12 seeds, prefix L0 TTFT p90 median 153 -> 100 ms, and no
  cell worse (docs/real-engines.md, "The simulated presets before and after").

Unknown size or occupancy (a pod whose events the gateway does not follow) is priced
as a full cache; a followed pod whose events stored nothing holds nothing (a pod just
started or reset is empty).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvindex.lru import BoundedLRU
from kvindex.types import Bound, PrefixMatch
from routing.calibration import Calibrator, Point
from routing.cost_model import CostModel, as_cost_model, running_requests
from routing.pod_speed import PodSpeeds
from routing.strategy_registry import register
from routing.types import (
    Decision,
    Need,
    Outcome,
    PodView,
    Reason,
    RouteRequest,
    Strategy,
    least_loaded_key,
)

_TIE_QUANTUM_S = 1e-6  # predictions closer than 1 us are a tie (float noise, not signal)


@dataclass(frozen=True, slots=True)
class PodEstimate:
    """One candidate's predicted tier split and TTFT."""

    pod: PodView
    l0: int
    l1: int
    l2: int
    ttft_s: float
    eviction_s: float = 0.0  # expected future cost of what writing the rest evicts

    @property
    def cached(self) -> int:
        return self.l0 + self.l1 + self.l2

    @property
    def score_s(self) -> float:
        """What the candidate is ranked by: predicted TTFT plus the eviction cost."""
        return self.ttft_s + self.eviction_s


@register("kv-aware", aliases=("kvaware", "kv", "precise", "cost-aware"))
class KvAware(Strategy):
    """Minimum predicted TTFT + eviction cost over the candidates (KV index, cost model)."""

    needs = frozenset({Need.INDEX})  # the gateway tokenizes, keys and looks the prompt up

    def __init__(
        self,
        cost_model: CostModel | Mapping[str, Any] | None = None,
        models: Mapping[str, CostModel | Mapping[str, Any]] | None = None,
        calibrate: bool = True,
        calibration: Mapping[str, Any] | None = None,
        max_models: int = 64,
        eviction_weight: float = 1.0,
        roomy_share: float = 0.25,
        pod_speeds: bool = True,
        pod_speed_evidence_z: float = 2.0,
        learn_at_first_token: bool = True,
    ) -> None:
        """``cost_model``: default for every model; ``models``: per served-model-name
        overrides laid over it; ``calibration``: ``Calibrator`` keyword options
        (window, min_samples, refit_every, max_change, min_pair_tokens);
        ``eviction_weight``: how many times each L0 block a placement evicts is expected
        to be needed again (0: rank by predicted TTFT alone); ``roomy_share``: the
        share of a pod's L0 below which writing evicts nothing (0: every write is priced
        as evicting); ``pod_speeds``: price each pod at its own observed speed relative
        to the calibrated model (off, or calibration off: every pod alike);
        ``pod_speed_evidence_z``: how many standard errors a pod's speed must stand from
        the average's to count (``routing.pod_speed``); ``learn_at_first_token``: learn
        from each request at its first token, with the tokens cached that the index
        predicted, rather than at its end with the engine's count (module docstring)."""
        if not eviction_weight >= 0:
            raise ValueError("kv-aware: eviction_weight must be >= 0")
        if not 0 <= roomy_share <= 1:
            raise ValueError("kv-aware: roomy_share must be within [0, 1]")
        self.eviction_weight = eviction_weight
        self.roomy_share = roomy_share
        self.default_cost = as_cost_model(cost_model)
        self._static: dict[str, CostModel] = {
            name: value
            if isinstance(value, CostModel)
            else CostModel.from_dict(value, self.default_cost)
            for name, value in (models or {}).items()
        }
        self.calibrate = calibrate
        self.learns_at_first_token = calibrate and learn_at_first_token
        self._calibration = dict(calibration or {})
        self._calibrators: BoundedLRU[str, Calibrator] = BoundedLRU(max_models)
        self.speeds: PodSpeeds | None = (
            PodSpeeds(evidence_z=pod_speed_evidence_z) if calibrate and pod_speeds else None
        )
        Calibrator(self.default_cost, **self._calibration)  # bad options fail at start-up

    def bounds(self) -> dict[str, Bound]:
        """Calibrators, one per model seen (a full 128-point window is ~17 kB), and the
        pods' speeds, one per (model, pod) seen."""
        cal = self._calibrators
        bounds = {"calibrators": Bound(len(cal), cal.capacity, "models", 17_000)}
        if self.speeds is not None:
            bounds["pod_speeds"] = self.speeds.bound()
        return bounds

    def forget_pod(self, pod: str) -> None:
        """The removed pod's speeds go; the model's other pods are then priced relative
        to the pods that remain."""
        if self.speeds is not None:
            self.speeds.forget_pod(pod)

    def cost_model(self, model: str) -> CostModel:
        """The model's current cost model (calibrated if calibration is on)."""
        if not self.calibrate:
            return self._static.get(model, self.default_cost)
        return self.calibrator(model).current()

    def pod_cost_model(self, model: str, pod: str, cost: CostModel | None = None) -> CostModel:
        """The model's cost model (``cost``: as ``cost_model`` gave it) for ``pod``, at
        that pod's observed speed."""
        cost = self.cost_model(model) if cost is None else cost
        return cost if self.speeds is None else self.speeds.scaled(model, pod, cost)

    def calibrators(self) -> list[tuple[str, Calibrator]]:
        """Each model's calibrator (none while calibration is off), to pool replicas'
        points (``gateway.fleet_calibration``)."""
        if not self.calibrate:
            return []
        cal = self._calibrators
        return [(model, c) for model in list(cal) if (c := cal.get(model)) is not None]

    def calibrator(self, model: str) -> Calibrator:
        cal = self._calibrators.get(model)
        if cal is None:
            base = self._static.get(model, self.default_cost)
            cal = Calibrator(base, **self._calibration)
            self._calibrators.put(model, cal)
        return cal

    def pick(
        self,
        req: RouteRequest,
        pods: Sequence[PodView],
        match: PrefixMatch | None,
        now: float,
    ) -> Decision:
        model = req.model
        cost = self.cost_model(model)
        anywhere = _held_anywhere(match)
        pod_cost = self.pod_cost_model
        estimates = [
            self.estimate(pod_cost(model, pod.id, cost), req, pod, match, anywhere) for pod in pods
        ]
        best = min(estimates, key=_rank)
        best_cost = pod_cost(model, best.pod.id, cost)
        return Decision(
            pod=best.pod.id,
            strategy=self.name,
            reason=_reason(best, estimates, match),
            predicted_l0_tokens=best.l0,
            predicted_l1_tokens=best.l1,
            predicted_l2_tokens=best.l2,
            predicted_ttft_s=best.ttft_s,
            scores={e.pod.id: e.score_s for e in estimates},
            predicted_queue_s=best_cost.queue_delay_s(best.pod),
            predicted_running=running_requests(best.pod),
            speculate_blocks=match.total_blocks if match is not None else 0,
        )

    def estimate(
        self,
        cost: CostModel,
        req: RouteRequest,
        pod: PodView,
        match: PrefixMatch | None,
        held_anywhere: int | None = None,
    ) -> PodEstimate:
        """Tier split, predicted TTFT and eviction cost of ``req`` on ``pod``.
        ``held_anywhere``: the blocks of the prompt some pod or L2 holds (``pick`` works
        it out once for all candidates; None: from ``match``)."""
        bs = match.block_size if match is not None else cost.block_size
        prompt = req.prompt_tokens
        if prompt <= 0 and match is not None:
            prompt = match.total_blocks * bs  # unknown length: at least its full blocks
        if match is None or bs <= 0:
            return PodEstimate(pod, 0, 0, 0, cost.predict_ttft_s(pod, 0, 0, 0, prompt))
        cap = max(0, (prompt - 1) // bs * bs)  # vLLM recomputes the last token
        held = match.for_pod(pod.id)
        l0 = min(held.l0 * bs, cap)
        l0_l1 = max(l0, min(held.l0_l1 * bs, cap))
        l2_reach = min(match.l2 * bs, cap)
        l1, l2 = cost.plan_loads(l0_l1 - l0, max(0, l2_reach - l0_l1))
        ttft = cost.predict_ttft_s(pod, l0, l1, l2, prompt)
        # The full blocks beyond the pod's L0 prefix get written into its L0 (loaded or
        # computed). A serving pod's L0 is full of cached prefixes (vLLM's usage gauge
        # counts only running requests' blocks, so "full" cannot be read from it): the
        # write evicts as many blocks, which their next request must fetch again. Priced
        # like this request's own missing blocks (loads where it loads, prefill where it
        # computes), times ``eviction_weight``. Where the pod's L0 size and occupancy are
        # known, only the blocks that do not fit evict anything (``evicted_blocks``);
        # where they are not, a new prompt is priced alike on every pod.
        evict = self.eviction_weight * cost.fill_s(l1, l2, cap - l0 - l1 - l2)
        if evict > 0.0 and pod.kv_capacity_blocks > 0 and pod.kv_held_blocks is not None:
            written = (cap - l0) // bs
            if held_anywhere is None:
                held_anywhere = _held_anywhere(match)
            copies = max(0, min(held_anywhere, cap // bs) - l0 // bs)
            size, occupied = pod.kv_capacity_blocks, pod.kv_held_blocks
            evicted = evicted_blocks(
                copies,
                written - copies,
                roomy_room=int(size * self.roomy_share) - occupied,
                free_room=size - occupied - pod.in_flight_prefill_tokens // bs,
            )
            evict *= evicted / written if written > 0 else 0.0
        return PodEstimate(pod, l0, l1, l2, ttft, evict)

    def observe(self, req: RouteRequest, decision: Decision, outcome: Outcome) -> _Learnt | None:
        """Calibrate the model's prefill and per-running costs, and the pod's speed
        relative to them, from the observed TTFT. Returns the point and ratio added."""
        if not self.calibrate or not outcome.ok:
            return None
        prompt = outcome.prompt_tokens if outcome.prompt_tokens is not None else req.prompt_tokens
        if req.block_keys and not _counts_agree(prompt, req.prompt_tokens):
            # The gateway tokenized this prompt (block keys): a pod reporting a count far
            # from it is wrong or lying, and one pod's counts would refit the cost model
            # every pod of the model is routed on. (An image the engine expands is also
            # skipped: the fit learns from the prompts the gateway can count.)
            return None
        calibrator = self.calibrator(req.model)
        # The calibrator fits the running requests' share itself: take it out of the
        # predicted queue (at the pod's current estimate, which refits move only slowly).
        running = decision.predicted_running
        fitted = calibrator.current()
        speed = 1.0 if self.speeds is None else self.speeds.factor(req.model, decision.pod)
        queue_s = max(0.0, (decision.predicted_queue_s or 0.0)
                      - running * fitted.decode_s_per_running * speed)  # fmt: skip
        accepted = calibrator.update(
            outcome.ttft_s,
            prompt,
            outcome.cached_tokens,
            queue_s=queue_s,
            running=running,
            l0_tokens=decision.predicted_l0_tokens,
            l1_tokens=decision.predicted_l1_tokens,
            l2_tokens=decision.predicted_l2_tokens,
            compute_scale=speed,
        )
        point = calibrator.last_point
        if not accepted or point is None:
            return None
        log_ratio = None
        if self.speeds is not None:
            # The pod's compute (queue and prefill, tier loads out) against an average
            # pod's, from the point the calibrator took as an average pod's.
            uncached, _, prefill_s = point
            cached_s = (prompt - uncached) * fitted.prefill_s_per_cached_token
            observed_s = speed * (prefill_s + cached_s) + queue_s
            average_s = (queue_s / speed + fitted.prefill_s(uncached)
                         + running * fitted.decode_s_per_running + cached_s)  # fmt: skip
            log_ratio = self.speeds.observe(req.model, decision.pod, observed_s, average_s)
        return _Learnt(point, log_ratio)

    def revise(
        self, req: RouteRequest, decision: Decision, learnt: object, outcome: Outcome
    ) -> None:
        """The engine's cached count contradicted the index's at the first token: the
        point taken then put a cold prefill's time on a cache hit (or the reverse), which
        would raise (lower) the fitted overhead and make the pod look slow (fast). Take
        it and its speed ratio back, and learn the request from the engine's counts."""
        if not self.calibrate or not isinstance(learnt, _Learnt):
            return
        self.calibrator(req.model).retract(learnt.point)
        if self.speeds is not None and learnt.log_ratio is not None:
            self.speeds.retract(req.model, decision.pod, learnt.log_ratio)
        self.observe(req, decision, outcome)


@dataclass(frozen=True, slots=True)
class _Learnt:
    """What one ``observe`` added: the calibrator's point and the pod's speed ratio."""

    point: Point
    log_ratio: float | None


def _held_anywhere(match: PrefixMatch | None) -> int:
    """Blocks of the prompt's prefix that some pod's L0/L1 or the fleet's L2 holds."""
    if match is None:
        return 0
    return max([match.l2, *(held.l0_l1 for held in match.pods.values())])


def evicted_blocks(copies: int, new: int, roomy_room: int, free_room: int) -> int:
    """How many of a write's L0 blocks evict a cached block (vLLM fills free blocks
    before it evicts). ``copies`` are blocks held elsewhere (another pod, the L2 tier or
    the pod's own L1), written first (a prompt's held part is its head); they evict
    beyond ``roomy_room``, the room left under ``roomy_share`` of the cache, since room
    above that is a cache under pressure that is empty only for its first seconds
    (module docstring). ``new`` blocks are held nowhere: they must be written on some
    pod, so the pod with room for them is the one where they evict nothing; they evict
    beyond the ``free_room`` the copies left (the pod's free blocks less those its
    prefills in flight will write)."""
    return max(0, copies - max(0, roomy_room)) + max(0, new - max(0, free_room - copies))


def _counts_agree(reported: int, exact: int) -> bool:
    """Whether a pod's prompt count is within 2x of the gateway's own (templates and
    tokenizer versions differ by a few tokens, not by a factor)."""
    return exact // 2 <= reported <= 2 * exact


def _rank(e: PodEstimate) -> tuple[int, tuple[int, int, int, str]]:
    return (round(e.score_s / _TIE_QUANTUM_S), least_loaded_key(e.pod))


def _reason(best: PodEstimate, estimates: Sequence[PodEstimate], match: PrefixMatch | None) -> str:
    if match is None or match.total_blocks <= 0:
        return Reason.FALLBACK
    if any(e.cached > best.cached for e in estimates):
        return Reason.LOAD_SPILL  # a pod with a longer usable prefix lost on its queue
    return Reason.CACHE_HIT if best.cached > 0 else Reason.LEAST_LOADED
