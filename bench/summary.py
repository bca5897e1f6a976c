"""Summaries of load-generator results: per router and per pod."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.loadgen import RequestResult
from bench.stats import percentile, prediction_error

MAX_ERROR_KINDS = 5


@dataclass(frozen=True)
class RunSummary:
    label: str
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    e2e_p50_ms: float
    cached_ratio: float  # cached prompt tokens / prompt tokens, as the pods reported in usage
    per_pod: dict[str, int]
    duration_s: float
    # median |predicted - observed| / observed TTFT, for routers that predict it
    ttft_prediction_error: float | None = None
    # What the failed requests said: each distinct message (the client's exception, cut
    # at 160 characters) with its count, the MAX_ERROR_KINDS most frequent, so a failed
    # request in a long run can be explained from its report.
    error_kinds: dict[str, int] = field(default_factory=dict)

    @property
    def throughput_rps(self) -> float:
        """Completed requests per second of wall time."""
        ok = self.requests - self.errors
        return ok / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def summarize(label: str, results: Sequence[RequestResult], duration_s: float) -> RunSummary:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return RunSummary(
        label=label,
        requests=len(results),
        errors=len(results) - len(ok),
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p90_ms=percentile(ttft, 90),
        ttft_p99_ms=percentile(ttft, 99),
        ttft_mean_ms=sum(ttft) / len(ttft) if ttft else math.nan,
        e2e_p50_ms=percentile([r.e2e_s * 1000 for r in ok], 50),
        cached_ratio=cached / prompt if prompt else 0.0,
        per_pod=dict(sorted(Counter(r.pod for r in ok if r.pod).items())),
        duration_s=duration_s,
        ttft_prediction_error=prediction_error(ok),
        error_kinds=dict(
            Counter(r.error or "(no message)" for r in results if not r.ok).most_common(
                MAX_ERROR_KINDS
            )
        ),
    )
