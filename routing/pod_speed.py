"""Per-pod speed of a model's pods, relative to the model's average pod.

The calibrator (``routing.calibration``) fits one cost model per model from every pod's
requests, so it predicts an average pod. Pods of one model are not equally fast: on
two CPU cores running two vLLM pods, the gateway and the load generator, one pod's
TTFTs at the same in-flight count were predicted 27% low and the other's 46% high
(``kvgate bench real``, chat at concurrency 8); on three pods, two
of which share a core, the pod with a core of its own was over-predicted by 27-56% in
every cell and the other two under-predicted by 10-41% (docs/real-engines.md). GPU
fleets have the same spread where pods differ in card, clocks, tensor-parallel width or
neighbours. A router that prices every pod alike sends too little to the fast pod and
prices a copy onto a slow one too cheaply.

``PodSpeeds`` keeps, per (model, pod), the last ``window`` ratios of the compute time a
request waited and took on the pod (its TTFT less the tier loads) to what the fitted
model predicts for it on an average pod (its queue and its prefill). A pod's raw speed
is the median of its ratios (robust to a stalled request, as the calibrator's fit is);
its factor is that over the geometric mean of the raw speeds of the model's pods, within
[1 / ``max_factor``, ``max_factor``], moved ``evidence_z`` (2) standard errors of its
median towards 1. Until a pod has ``min_samples`` ratios it is not counted and its
factor is 1.

Why the evidence: while the model itself is still being fitted (a gateway's first
requests), each pod's ratios say more about which requests it got than about its
speed. In the DES, whose pods are identical, factors of 0.66-1.6 came and went over the
first ~70 requests, and six of twelve seeds of the quick preset's RAG cell on L0 came
out worse (TTFT p90 median 83 -> 89 ms, worst 128 -> 208); moved two standard errors
towards 1 the DES is unchanged seed for seed, while a pod whose ratios sit apart from
the others' (the real pods' 27-56%) keeps most of its factor.

Why relative to the model's pods: the calibrator fits each point as on an average pod
(its TTFT less the queue, divided by the pod's factor), so model and factors share one
scale. Left free, that scale drifts: a model twice as slow with every factor halved
predicts the same; pinning the factors' geometric mean at 1 makes the model the
average pod's. Why the ratio takes the queue as well as the prefill, both at the
average pod's speed: a ratio of the prefill alone, with the queue taken out at the
pod's own factor, feeds the factor back into itself by the queue's share of the TTFT
(several times the prefill's behind a queue) and swings.

``scaled`` gives the model with a pod's prefill, overhead, per-running and
per-cached-token costs times its factor (tier loads are I/O and stay as they are); the
strategy prices the pod's queue, prefill and eviction with it. Each ratio is against
the model current when the request finished; the window is short (32 requests a pod),
so a refit is folded in within a window. Each gateway replica keeps its own factors
(not pooled like the calibrator's points): a factor needs only its pod's requests, of
which every replica sees a share.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import fmean, median

from kvindex.lru import BoundedLRU
from kvindex.types import Bound
from routing.calibration import remove_last
from routing.cost_model import CostModel

_MIN_PREDICTED_S = 1e-4  # a prediction below 0.1 ms is not a ratio's denominator
# The standard error of a median of n normal samples is ~1.2533 sigma / sqrt(n), and
# sigma ~1.4826 x the median absolute deviation.
_SE_PER_MAD = 1.2533 * 1.4826


class PodSpeeds:
    """Bounded per-(model, pod) compute speed factors and the scaled cost models."""

    def __init__(
        self,
        window: int = 32,
        min_samples: int = 8,
        max_factor: float = 4.0,
        max_pods: int = 4096,
        evidence_z: float = 2.0,
    ) -> None:
        if window < 1 or not 1 <= min_samples <= window or not max_factor >= 1:
            raise ValueError("pod speeds: 1 <= min_samples <= window, max_factor >= 1")
        if not evidence_z >= 0:
            raise ValueError("pod speeds: evidence_z must be >= 0")
        self.window = window
        self.min_samples = min_samples
        self.max_factor = max_factor
        self.evidence_z = evidence_z
        self._log_max = math.log(max_factor)
        # Per pair, its last ratios' logs (clamped to +-log max_factor).
        self._ratios: BoundedLRU[tuple[str, str], deque[float]] = BoundedLRU(max_pods)
        # Per model, each counted pod's (log raw speed, its standard error).
        self._speeds: dict[str, dict[str, tuple[float, float]]] = {}
        self._factors: dict[tuple[str, str], float] = {}
        # The last scaled model per pair: (base it was scaled from, factor, scaled).
        self._scaled: dict[tuple[str, str], tuple[CostModel, float, CostModel]] = {}

    def bound(self) -> Bound:
        """(model, pod) pairs tracked; a full window of 32 floats is ~1.5 kB."""
        return Bound(len(self._ratios), self._ratios.capacity, "model pods", 1_500)

    def observe(self, model: str, pod: str, observed_s: float, predicted_s: float) -> float:
        """Add one finished request on ``pod``: the compute time it waited and took
        (``observed_s``) and what the model predicts for it on an average pod. Returns
        the ratio's log as kept, which ``retract`` takes back."""
        ratio = max(observed_s, 0.0) / max(predicted_s, _MIN_PREDICTED_S)
        log_ratio = math.log(ratio) if ratio > 0 else -self._log_max
        log_ratio = min(max(log_ratio, -self._log_max), self._log_max)
        key = (model, pod)
        ratios = self._ratios.touch(key)  # a pod still serving stays
        if ratios is None:
            ratios = deque(maxlen=self.window)
            self._ratios.put(key, ratios)
            self._forget_evicted()
        ratios.append(log_ratio)
        self._respeed(model, pod, ratios)
        return log_ratio

    def retract(self, model: str, pod: str, log_ratio: float) -> bool:
        """Take back the latest ratio ``observe`` kept as ``log_ratio`` (a request
        observed with counts the engine then contradicted); False if it has left the
        window."""
        ratios = self._ratios.get((model, pod))
        if ratios is None or not remove_last(ratios, log_ratio):
            return False
        self._respeed(model, pod, ratios)
        return True

    def _respeed(self, model: str, pod: str, ratios: deque[float]) -> None:
        """The pod's raw speed from its ratios, then every factor of the model."""
        if len(ratios) >= self.min_samples:
            speed = median(ratios)
            spread = median(abs(r - speed) for r in ratios)
            error = _SE_PER_MAD * spread / math.sqrt(len(ratios))
            self._speeds.setdefault(model, {})[pod] = (speed, error)
        elif self._speeds.get(model, {}).pop(pod, None) is None:
            return  # not counted before either: no factor moves
        else:
            self._factors.pop((model, pod), None)
        self._refactor(model)

    def factor(self, model: str, pod: str) -> float:
        """How many times the model's average pod's compute time ``pod`` takes (1: not
        known yet, or not told apart from the average)."""
        return self._factors.get((model, pod), 1.0)

    def of_pod(self, pod: str) -> dict[str, float]:
        """``pod``'s factor per model it is told apart from the average for (an admin
        listing; O(pairs))."""
        return {model: factor for (model, name), factor in self._factors.items() if name == pod}

    def scaled(self, model: str, pod: str, cost: CostModel) -> CostModel:
        """``cost`` with ``pod``'s compute costs times its factor (``cost`` itself at 1).
        The scaled model is kept until the base or the factor changes: a request's pick
        asks once per candidate pod."""
        key = (model, pod)
        factor = self._factors.get(key, 1.0)
        if factor == 1.0:
            return cost
        kept = self._scaled.get(key)
        if kept is not None and kept[0] is cost and kept[1] == factor:
            return kept[2]
        scaled = cost.compute_scaled(factor)
        self._scaled[key] = (cost, factor, scaled)
        return scaled

    def forget_pod(self, pod: str) -> None:
        """``pod`` left the fleet: its ratios go, and the model's other pods' factors
        are taken relative to the pods that remain. Kept, a removed pod would stay in
        its model's geometric mean until the LRU evicted it, and a new pod (at factor 1
        until it has ``min_samples`` ratios) would be priced off by its share of it.
        O(pairs): a pod leaves the fleet rarely."""
        gone = [key for key in self._ratios if key[1] == pod]
        for key in gone:
            self._ratios.pop(key)
        if gone:
            self._forget_evicted()

    def _refactor(self, model: str) -> None:
        """Each counted pod's factor: its log speed less the mean of the model's pods',
        moved ``evidence_z`` standard errors towards 0 (a pod no further than that from
        the average is the average)."""
        speeds = self._speeds.get(model)
        if not speeds:
            return
        mean = fmean(speed for speed, _ in speeds.values())
        for pod, (speed, error) in speeds.items():
            offset = speed - mean
            shrunk = max(0.0, abs(offset) - self.evidence_z * error)
            factor = math.exp(min(shrunk, self._log_max) * (1 if offset > 0 else -1))
            if factor == 1.0:
                self._factors.pop((model, pod), None)
            else:
                self._factors[(model, pod)] = factor

    def _forget_evicted(self) -> None:
        """Drop what pairs the bounded LRU evicted (or ``forget_pod`` removed) leave
        behind. Run when a pair is added or a pod leaves (rare), so nothing here
        outgrows the LRU."""
        live = set(self._ratios)
        for kept in (self._factors, self._scaled):
            for stale in [key for key in kept if key not in live]:
                del kept[stale]
        for model, speeds in list(self._speeds.items()):
            for pod in [pod for pod in speeds if (model, pod) not in live]:
                del speeds[pod]
            if speeds:
                self._refactor(model)
            else:
                del self._speeds[model]
