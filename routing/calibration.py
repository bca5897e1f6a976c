"""Online calibration of the cost model's prefill parameters from observed TTFTs.

Per finished request the gateway knows the observed TTFT, ``usage.prompt_tokens``,
``usage.prompt_tokens_details.cached_tokens`` and what routing predicted (queue delay,
tokens per tier). Subtracting the predicted queue delay and tier loads leaves the
prefill part, a line in the uncached token count:

    ttft - queue - load(L1) - load(L2) = overhead + uncached * s_per_token

``Calibrator`` keeps the last ``window`` such points in a ring buffer and fits the line
with Theil-Sen (median of pairwise slopes, then median intercept). Its breakdown point
is ~29%: one 100x outlier, a stalled pod or a clock hiccup, barely moves it, where a
least-squares fit or plain EMA would swing. The fit is clamped within ``max_change`` x
of the base model and only replaces it after ``min_samples`` points. Tier bandwidths
and latencies stay as configured: TTFT alone cannot separate them from prefill.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from statistics import median

from kvindex.types import Tier
from routing.cost_model import CostModel


class Calibrator:
    """Robust, bounded estimator of ``prefill_overhead_s`` and prefill tokens/s."""

    def __init__(
        self,
        base: CostModel | None = None,
        window: int = 128,
        min_samples: int = 16,
        refit_every: int = 8,
        max_change: float = 20.0,
    ) -> None:
        if window < 2 or min_samples < 2 or refit_every < 1 or max_change < 1:
            raise ValueError("calibrator: window/min_samples >= 2, refit_every >= 1")
        self.base = base or CostModel()
        self._points: deque[tuple[int, float]] = deque(maxlen=window)
        self._min_samples = min_samples
        self._refit_every = refit_every
        self._max_change = max_change
        self._since_fit = 0
        self._model = self.base
        self.accepted = 0
        self.rejected = 0  # bad observations: counted and skipped, never fatal

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
        l0_tokens: int = 0,
        l1_tokens: int = 0,
        l2_tokens: int = 0,
    ) -> bool:
        """Add one observation; returns False (and counts it) if it is unusable.

        ``l*_tokens`` are the predicted tier split; the observed ``cached_tokens`` is
        attributed to L0, then L1, then L2 in that order, any excess to L0 (a stale
        index is the usual cause). ``cached_tokens=None`` (no prompt-token details
        from the engine) trusts the prediction.
        """
        if not _valid(ttft_s, prompt_tokens, cached_tokens, queue_s):
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
        prefill = ttft_s - queue_s - model.load_s(Tier.L1, l1) - model.load_s(Tier.L2, l2)
        self._points.append((max(1, prompt_tokens - cached), prefill))
        self.accepted += 1
        self._since_fit += 1
        if len(self._points) >= self._min_samples and self._since_fit >= self._refit_every:
            self.refit()
        return True

    def refit(self) -> CostModel:
        """Fit now (normally every ``refit_every`` updates) and return the model."""
        self._since_fit = 0
        if len(self._points) < self._min_samples:
            return self._model
        slope = _theil_sen_slope(self._points)
        if slope is None:  # all prompts the same length: keep the slope, fit the offset
            slope = self._model.prefill_s_per_token
        base_c = self.base.prefill_s_per_token
        slope = min(max(slope, base_c / self._max_change), base_c * self._max_change)
        overhead = median(y - slope * x for x, y in self._points)
        overhead_cap = max(self.base.prefill_overhead_s * self._max_change, 1.0)
        overhead = min(max(overhead, 0.0), overhead_cap)
        self._model = replace(
            self.base, prefill_tokens_per_s=1.0 / slope, prefill_overhead_s=overhead
        )
        return self._model


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


def _theil_sen_slope(points: deque[tuple[int, float]]) -> float | None:
    """Median of pairwise slopes over points with distinct x; None if there are none."""
    pts = list(points)
    slopes: list[float] = []
    for i, (x1, y1) in enumerate(pts):
        for x2, y2 in pts[i + 1 :]:
            if x2 != x1:
                slopes.append((y2 - y1) / (x2 - x1))
    return median(slopes) if slopes else None
