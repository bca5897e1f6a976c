"""kvgate with one setting changed, named ``STRATEGY/VARIANT`` in benchmark reports
(``kv-aware/no-speculation``): what the setting buys, measured in the same run as the
default, by the fleet on simulated or real pods (as gateway settings) and by the DES
(as the simulated router's arguments)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Variant:
    name: str
    speculative_ttl_s: float = 3.0  # IndexSettings.speculative_ttl_s
    # kv-aware's options instead of the benchmark's (its measured or simulated cost
    # model); None: the benchmark's.
    kv_options: dict[str, Any] | None = field(default=None, hash=False)

    def gateway_env(self) -> dict[str, str]:
        """The variant as ``kvgate serve`` environment settings."""
        env = {"KVGATE_INDEX__SPECULATIVE_TTL_S": str(self.speculative_ttl_s)}
        if self.kv_options is not None:
            env["KVGATE_STRATEGY_OPTIONS"] = json.dumps({"kv-aware": self.kv_options})
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
}


def split_variant(router: str) -> tuple[str, Variant]:
    """``kv-aware/no-speculation`` -> (``kv-aware``, its variant); no ``/``: the default."""
    strategy, _, name = router.partition("/")
    if not name:
        return strategy, DEFAULT
    if name not in VARIANTS:
        raise ValueError(f"unknown kvgate variant {name!r} (known: {', '.join(VARIANTS)})")
    return strategy, VARIANTS[name]
