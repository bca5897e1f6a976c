"""The strategies of one router: a default and per-model overrides, and what built them.

A ``StrategySet`` remembers the (canonical name, options) each strategy was built
from, so a new configuration can be built *over* the running one (``build(...,
reuse=running)``): a model whose strategy name and options did not change keeps its
strategy object, and with it what that strategy has learnt (kv-aware's calibration,
prefix-aware's prefix memory, session's affinities); only what changed is new.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from routing.strategy_registry import build_strategy, canonical_name
from routing.types import Strategy


@dataclass(frozen=True, slots=True)
class StrategySpec:
    """What one strategy object was built from: its canonical name and its options."""

    name: str
    options: Mapping[str, Any] | None

    @classmethod
    def of(cls, name: str, options: Mapping[str, Mapping[str, Any]] | None) -> StrategySpec:
        """The spec of strategy ``name`` (an alias allowed) under the per-strategy
        ``options`` of a configuration; an unknown name raises ``ValueError``."""
        canonical = canonical_name(name)
        own = (options or {}).get(canonical)
        return cls(canonical, copy.deepcopy(dict(own)) if own is not None else None)


@dataclass(slots=True)
class StrategySet:
    """The default strategy, per-model overrides, and the specs they were built from
    (absent when the caller built the objects itself: nothing can be reused then)."""

    default: Strategy
    per_model: dict[str, Strategy] = field(default_factory=dict)
    default_spec: StrategySpec | None = None
    model_specs: dict[str, StrategySpec] = field(default_factory=dict)

    def for_model(self, model: str) -> Strategy:
        return self.per_model.get(model, self.default)

    def spec_for(self, model: str) -> StrategySpec | None:
        return self.model_specs.get(model, self.default_spec)

    def strategies(self) -> list[Strategy]:
        return [self.default, *self.per_model.values()]

    @classmethod
    def build(
        cls,
        default: str,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        model_strategies: Mapping[str, str] | None = None,
        *,
        reuse: StrategySet | None = None,
    ) -> StrategySet:
        """Build the strategies by (alias) name, options keyed by canonical name; an
        unknown name or a bad option raises here, before anything is replaced.

        With ``reuse``, a strategy whose spec equals the one that served the same
        models in ``reuse`` is that object, not a new one."""
        default_spec = StrategySpec.of(default, options)
        model_specs = {m: StrategySpec.of(n, options) for m, n in (model_strategies or {}).items()}

        def strategy(spec: StrategySpec, running: Strategy | None,
                     was: StrategySpec | None) -> Strategy:  # fmt: skip
            if running is not None and was == spec:
                return running
            return build_strategy(spec.name, spec.options)

        built_default = strategy(
            default_spec, reuse.default if reuse else None, reuse.default_spec if reuse else None
        )
        per_model = {
            model: strategy(
                spec,
                reuse.for_model(model) if reuse else None,
                reuse.spec_for(model) if reuse else None,
            )  # fmt: skip
            for model, spec in model_specs.items()
        }
        return cls(built_default, per_model, default_spec, model_specs)
