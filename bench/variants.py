"""kvgate with one setting changed, named ``STRATEGY/VARIANT`` in benchmark reports
(``kv-aware/no-speculation``): what the setting buys, measured in the same run as the
default, by the fleet on simulated or real pods (as gateway settings) and by the DES
(as the simulated router's arguments)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from routing.cost_model import CostModel


@dataclass(frozen=True)
class Variant:
    name: str
    speculative_ttl_s: float = 3.0  # IndexSettings.speculative_ttl_s
    # kv-aware's options instead of the benchmark's (its measured or simulated cost
    # model); None: the benchmark's.
    kv_options: dict[str, Any] | None = field(default=None, hash=False)
    # kv-aware options laid over the benchmark's (or ``kv_options``): one option changed,
    # the measured or simulated cost model kept.
    kv_overrides: dict[str, Any] = field(default_factory=dict, hash=False)
    # kv-aware cost-model keys laid over the benchmark's cost model (the rest kept).
    cost_model_overrides: dict[str, Any] = field(default_factory=dict, hash=False)
    # Options of strategies other than kv-aware, by canonical name, laid over theirs
    # (kv-aware's, measured or simulated, kept beside them).
    strategy_options: dict[str, dict[str, Any]] = field(default_factory=dict, hash=False)
    # Other gateway settings, as environment variables (the gateway's HTTP path only:
    # the DES has none, so there the variant is the default).
    gateway_settings: dict[str, str] = field(default_factory=dict, hash=False)

    def kv_aware_options(self, base: dict[str, Any] | None) -> dict[str, Any] | None:
        """kv-aware's options under this variant, given the benchmark's ``base``."""
        options = self.kv_options if self.kv_options is not None else base
        if not self.kv_overrides and not self.cost_model_overrides:
            return options
        options = {**(options or {}), **self.kv_overrides}
        if self.cost_model_overrides:
            base_model = options.get("cost_model") or {}
            if isinstance(base_model, CostModel):  # the DES passes the model itself
                base_model = base_model.to_dict()
            options["cost_model"] = {**base_model, **self.cost_model_overrides}
        return options

    def gateway_env(self, base_kv_options: dict[str, Any] | None = None) -> dict[str, str]:
        """The variant as ``kvgate serve`` environment settings; ``base_kv_options``:
        the benchmark's kv-aware options, which ``kv_overrides`` are laid over."""
        env = {"KVGATE_INDEX__SPECULATIVE_TTL_S": str(self.speculative_ttl_s),
               **self.gateway_settings}  # fmt: skip
        options: dict[str, Any] = dict(self.strategy_options)
        if self.kv_options is not None or self.kv_overrides or self.cost_model_overrides:
            options["kv-aware"] = self.kv_aware_options(base_kv_options)
        elif options and base_kv_options is not None:
            options["kv-aware"] = base_kv_options  # the whole setting is replaced: keep it
        if options:
            env["KVGATE_STRATEGY_OPTIONS"] = json.dumps(options)
        return env


DEFAULT = Variant("")
VARIANTS = {
    # Speculative placement off: a routed prompt counts as cached on its pod only once
    # the pod's KV events say so, so requests sharing a prefix that arrive together
    # spread as if nothing were cached.
    "no-speculation": Variant("no-speculation", speculative_ttl_s=0.0),
    # kv-aware as shipped, not configured for the pods: the default cost model (a GPU's
    # prefill) with online calibration, what a user gets who skips `kvgate bench
    # calibrate`.
    "default-cost-model": Variant("default-cost-model", kv_options={}),
    # No online calibration: the configured (measured or simulated) cost model as it
    # is, never fitted to observed TTFTs. Each replica of a scaled-out gateway
    # calibrates on its own share of the requests; this shows what that is worth.
    "no-calibration": Variant("no-calibration", kv_overrides={"calibrate": False}),
    # No eviction cost: rank pods by predicted TTFT alone, so a shared prefix spills to
    # a second pod as soon as that pod's cold prefill beats the holder's queue.
    "no-eviction-cost": Variant("no-eviction-cost", kv_overrides={"eviction_weight": 0.0}),
    # Every L0 write priced as evicting, however empty the pod's cache (roomy_share 0):
    # a pod lacking a prefix pays its prefill twice, so a hot prefix is copied later.
    "full-cache": Variant("full-cache", kv_overrides={"roomy_share": 0.0}),
    # Every pod priced at the model's average speed (``pod_speeds`` off): what pricing
    # each pod at its own observed speed (routing/pod_speed.py) buys.
    "one-speed": Variant("one-speed", kv_overrides={"pod_speeds": False}),
    # Learning from each request at its stream's end, with the engine's cached count,
    # instead of at its first token with the index's (``learn_at_first_token`` off).
    "learn-at-end": Variant("learn-at-end", kv_overrides={"learn_at_first_token": False}),
    # Cached tokens cost nothing: the measured cost per cached token set to 0, so a
    # deep prefix hit is predicted as its new tokens alone (what kv-aware did before it
    # modelled attention over the cached keys).
    "no-cached-cost": Variant(
        "no-cached-cost", cost_model_overrides={"prefill_s_per_cached_token": 0.0}
    ),
    # prefix-aware yielding affinity to load at sglang-router's default gap (64 requests
    # in flight beyond the least loaded pod's) instead of kvgate's 8. Both count the
    # router's own in-flight requests per pod.
    "sglang-balance": Variant(
        "sglang-balance", strategy_options={"prefix-aware": {"balance_abs_threshold": 64}}
    ),
    # No start-up replay of the pods' KV-event history (`index.warm_start` off): the
    # index learns only what the pods store after the gateway connects.
    "no-warm-start": Variant(
        "no-warm-start", gateway_settings={"KVGATE_INDEX__WARM_START": "false"}
    ),
    # A stream's headers sent as soon as the pod's arrive (`stream_headers_early`): the
    # client's response set-up overlaps the prefill; no retry after them.
    "early-headers": Variant(
        "early-headers", gateway_settings={"KVGATE_STREAM_HEADERS_EARLY": "true"}
    ),
}


def split_variant(router: str) -> tuple[str, Variant]:
    """``kv-aware/no-speculation`` -> (``kv-aware``, its variant); no ``/``: the default."""
    strategy, _, name = router.partition("/")
    if not name:
        return strategy, DEFAULT
    if name not in VARIANTS:
        raise ValueError(f"unknown kvgate variant {name!r} (known: {', '.join(VARIANTS)})")
    return strategy, VARIANTS[name]
