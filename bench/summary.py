"""Summaries of load-generator results: per strategy and per pod."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from bench.loadgen import RequestResult
from bench.stats import percentile


@dataclass(frozen=True)
class RunSummary:
    label: str
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    cached_ratio: float  # cached prompt tokens / prompt tokens
    per_pod: dict[str, int]
    duration_s: float

    @property
    def throughput_rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0


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
        e2e_p50_ms=percentile([r.e2e_s * 1000 for r in ok], 50),
        cached_ratio=cached / prompt if prompt else 0.0,
        per_pod=dict(sorted(Counter(r.pod for r in ok).items())),
        duration_s=duration_s,
    )
