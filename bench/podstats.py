"""What the pods say about a run: TTFT they measured, cached tokens per tier.

Read after each benchmark cell from every pod (fresh pods per cell, so counters
are the cell's own): ``/metrics`` (any vLLM: ``vllm:time_to_first_token_seconds``,
``vllm:prompt_tokens``, ``vllm:prompt_tokens_cached``) and, on simulated pods,
``/sim/state`` for the per-tier split. The per-tier keys are read tolerantly
(``cached_tokens_by_tier`` and ``l2_cross_pod_tokens`` as bench.sim reports
them; else ``hit_tokens``/``hit_blocks`` per tier entry) so the report works before and
after the simulator grows tiers, and says "n/a" when a pod does not tell.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

_CROSS_KEYS = ("cross_pod_hit", "l2_cross_pod_hit", "foreign_hit", "remote_hit")


@dataclass
class FleetStats:
    """Sums over the fleet's pods for one cell."""

    pod_ttft_sum_s: float = 0.0
    pod_ttft_count: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)  # tokens served per tier
    cross_pod_tokens: int | None = None  # L2 tokens another pod computed
    tiers_reported: bool = False  # False: only a total, no per-tier split

    @property
    def pod_ttft_mean_s(self) -> float | None:
        return self.pod_ttft_sum_s / self.pod_ttft_count if self.pod_ttft_count else None

    def tier_rate(self, tier: str) -> float | None:
        """Share of prompt tokens served from ``tier``."""
        if not self.tiers_reported or not self.prompt_tokens or tier not in self.tier_tokens:
            return None  # not reported, or the tier is not in this setup
        return self.tier_tokens[tier] / self.prompt_tokens

    @property
    def cross_pod_rate(self) -> float | None:
        """Share of L2-served tokens that another pod computed."""
        l2 = self.tier_tokens.get("L2", 0)
        if self.cross_pod_tokens is None or not l2:
            return None
        return self.cross_pod_tokens / l2


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample by name (labels dropped): enough for fleet totals."""
    out: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return out  # malformed exposition: counted as no data, never fatal
    for fam in families:
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
    return out


def _tokens(entry: dict[str, Any], stem: str, block_size: int) -> int | None:
    if f"{stem}_tokens" in entry:
        return int(entry[f"{stem}_tokens"])
    if f"{stem}_blocks" in entry:
        return int(entry[f"{stem}_blocks"]) * block_size
    return None


def tier_tokens_from_state(state: dict[str, Any]) -> tuple[dict[str, int], bool]:
    """Tokens served per tier; (split, True) when the pod reports one per tier."""
    bs = int(state.get("block_size", 1) or 1)
    tiers = [t for t in state.get("tiers", []) if isinstance(t, dict)]
    by_tier = state.get("cached_tokens_by_tier")
    if isinstance(by_tier, dict):  # bench.sim since tiers; only the tiers the pod has count
        return {
            name: int(by_tier.get(name, 0) or 0) for name in (str(t.get("name")) for t in tiers)
        }, True
    split: dict[str, int] = {}
    for t in tiers:
        n = _tokens(t, "hit", bs)
        if n is not None:
            split[str(t.get("name", "?"))] = n
    if split:
        return split, True
    names = [t.get("name") for t in tiers]
    if names == ["L0"]:  # an L0-only pod: all cached tokens came from L0
        return {"L0": int(state.get("cached_tokens", 0))}, True
    return {}, False


def cross_pod_from_state(state: dict[str, Any]) -> int | None:
    if isinstance(state.get("l2_cross_pod_tokens"), int):
        return int(state["l2_cross_pod_tokens"])
    bs = int(state.get("block_size", 1) or 1)
    entries = [state, *[t for t in state.get("tiers", []) if isinstance(t, dict)]]
    for entry in entries:
        for stem in _CROSS_KEYS:
            n = _tokens(entry, stem, bs)
            if n is not None:
                return n
    return None


def collect(pod_urls: list[str], simulated: bool, timeout_s: float = 5.0) -> FleetStats:
    """Fleet totals from every pod's /metrics (and /sim/state when simulated)."""
    stats = FleetStats()
    reported = True
    with httpx.Client(timeout=timeout_s) as client:
        for url in pod_urls:
            try:
                m = parse_metrics(client.get(f"{url}/metrics").text)
                state = client.get(f"{url}/sim/state").json() if simulated else {}
            except (httpx.HTTPError, ValueError):
                reported = False
                continue
            stats.pod_ttft_sum_s += m.get("vllm:time_to_first_token_seconds_sum", 0.0)
            stats.pod_ttft_count += int(m.get("vllm:time_to_first_token_seconds_count", 0))
            stats.prompt_tokens += int(m.get("vllm:prompt_tokens_total", 0))
            stats.cached_tokens += int(m.get("vllm:prompt_tokens_cached_total", 0))
            split, has = tier_tokens_from_state(state) if simulated else ({}, False)
            reported = reported and has
            for tier, n in split.items():
                stats.tier_tokens[tier] = stats.tier_tokens.get(tier, 0) + n
            cross = cross_pod_from_state(state) if simulated else None
            if cross is not None:
                stats.cross_pod_tokens = (stats.cross_pod_tokens or 0) + cross
    stats.tiers_reported = reported and bool(pod_urls)
    return stats


def histogram_median(buckets: dict[float, float]) -> float | None:
    """The median of a Prometheus histogram from its cumulative ``le`` buckets,
    interpolated linearly inside the bucket that holds it (as ``histogram_quantile``
    does); None when it is empty. A median past the last finite bound is that bound."""
    bounds = sorted(buckets)
    total = buckets.get(float("inf"), buckets[bounds[-1]] if bounds else 0.0)
    if not total:
        return None
    rank, below, lower = total / 2, 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if le == float("inf"):
                return lower
            inside = count - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        below, lower = count, le
    return lower


def _gateway_families(gateway_url: str) -> list[Metric] | None:
    """kvgate's ``/metrics``, parsed with its labels; None: no (well-formed) answer."""
    try:
        text = httpx.get(f"{gateway_url}/metrics", timeout=5.0).text
        return list(text_string_to_metric_families(text))
    except (httpx.HTTPError, ValueError):
        return None


def gateway_prediction_error(gateway_url: str) -> float | None:
    """Median of kvgate's own |predicted - observed| / observed TTFT, from its
    ``kvgate_predicted_ttft_relative_error`` histogram (every strategy together; a
    cell runs one). Observed on the gateway's clock, from the request's arrival to the
    pod's first byte: what the prediction is of, without the load generator's share
    of the machine. None when nothing was predicted or the gateway did not answer."""
    families = _gateway_families(gateway_url)
    if families is None:
        return None
    buckets: dict[float, float] = {}
    for fam in families:
        if fam.name != "kvgate_predicted_ttft_relative_error":
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + float(s.value)
    return histogram_median(buckets)


def _gateway_mean_ms(gateway_url: str, histogram: str) -> float | None:
    """Mean of one of kvgate's histograms (every label set together), in ms; None when
    it is empty or the gateway did not answer."""
    try:
        m = parse_metrics(httpx.get(f"{gateway_url}/metrics", timeout=5.0).text)
    except httpx.HTTPError:
        return None
    count = m.get(f"{histogram}_count", 0.0)
    return m.get(f"{histogram}_sum", 0.0) / count * 1000 if count else None


def gateway_loop_stalls(gateway_url: str, late_s: float = 0.02) -> int | None:
    """How many of kvgate's event-loop samples (one each 100 ms,
    ``kvgate_event_loop_lag_seconds``) woke more than ``late_s`` late: a stall of the
    gateway's own loop, which delays every request it holds, told apart from a pod's.
    ``late_s`` must be one of the histogram's bucket bounds. None: no answer."""
    families = _gateway_families(gateway_url)
    if families is None:
        return None
    count = on_time = None
    for fam in families:
        if fam.name != "kvgate_event_loop_lag_seconds":
            continue
        for sample in fam.samples:
            if sample.name.endswith("_count"):
                count = (count or 0.0) + sample.value
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == late_s:
                on_time = (on_time or 0.0) + sample.value
    if count is None or on_time is None:
        return None
    return int(count - on_time)


def routing_decision_ms(gateway_url: str) -> float | None:
    """Mean time kvgate spent choosing a pod (tokenize + index lookup + strategy)."""
    return _gateway_mean_ms(gateway_url, "kvgate_routing_decision_seconds")


def gateway_ttft_ms(gateway_url: str) -> float | None:
    """Mean time from a request's arrival at kvgate to the pod's first body byte there:
    kvgate's own work before the pod, the trip to it, the pod's server and its engine."""
    return _gateway_mean_ms(gateway_url, "kvgate_ttft_seconds")
