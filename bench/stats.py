"""Small statistics helpers shared by the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Predicted(Protocol):
    """A request's outcome with the TTFT its router predicted (loadgen's or the DES's)."""

    @property
    def predicted_ttft_s(self) -> float | None: ...

    @property
    def ttft_s(self) -> float: ...


def prediction_error(results: Iterable[Predicted]) -> float | None:
    """Median relative TTFT prediction error, |predicted - observed| / observed; None
    when no request has a prediction."""
    errors = [
        abs(r.predicted_ttft_s - r.ttft_s) / r.ttft_s
        for r in results
        if r.predicted_ttft_s is not None and r.ttft_s > 0
    ]
    return percentile(errors, 50) if errors else None


def pct(value: float | None) -> str:
    """A share as a whole percentage for report tables; "n/a" for none."""
    return "n/a" if value is None else f"{value:.0%}"
