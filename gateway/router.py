"""Turns a parsed request and the healthy pods into a routing ``Decision``.

This is the gateway side of routing: it builds the pure ``RouteRequest`` /
``PodView`` snapshot a strategy needs (load from the ``LoadTracker``, engine
queue from the registry's scrapes), picks the strategy configured for the model,
and records decision metrics. Strategies themselves stay pure in ``routing/``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from gateway.kv import KvIndex, Lookup
from gateway.metrics import GatewayMetrics
from gateway.openai_body import ParsedRequest
from gateway.registry import Pod
from kvindex.types import PrefixMatch
from routing.load import LoadTracker
from routing.prefix_hash import chat_prefix_hashes, text_prefix_hashes
from routing.registry import build_strategy, canonical_name
from routing.types import Decision, Outcome, PodView, RouteRequest, Strategy

CHARS_PER_TOKEN = 4  # estimate until a tokenizer is configured for the model


class Router:
    def __init__(
        self,
        default_strategy: str,
        metrics: GatewayMetrics,
        load: LoadTracker,
        strategy_options: dict[str, dict[str, object]] | None = None,
        model_strategies: dict[str, str] | None = None,
        kv: KvIndex | None = None,
        session_header: str = "x-session-id",
        session_body_field: str = "user",
    ) -> None:
        self._kv = kv
        self._session_header = session_header.lower()
        self._session_field = session_body_field
        self._metrics = metrics
        self._load = load
        self._options = strategy_options or {}
        self._default = self._build(default_strategy)
        self._per_model: dict[str, Strategy] = {
            model: self._build(name) for model, name in (model_strategies or {}).items()
        }

    def _build(self, name: str) -> Strategy:
        canonical = canonical_name(name)
        return build_strategy(canonical, self._options.get(canonical))

    def strategy_for(self, model: str) -> Strategy:
        return self._per_model.get(model, self._default)

    def uses_index(self, model: str) -> bool:
        """Whether requests for ``model`` are tokenized and looked up in the index."""
        return bool(getattr(self.strategy_for(model), "uses_index", False))

    async def prepare(
        self,
        parsed: ParsedRequest,
        model: str,
        request_id: str,
        headers: Mapping[str, str],
        pods: list[Pod],
    ) -> tuple[RouteRequest, Lookup | None]:
        """Build what the model's strategy needs, and only that (tokens cost time)."""
        strategy = self.strategy_for(model)
        req = RouteRequest(
            model=model,
            request_id=request_id,
            prompt_tokens=parsed.approx_prompt_chars() // CHARS_PER_TOKEN,
            stream=parsed.stream,
        )
        lookup = None
        if getattr(strategy, "uses_index", False) and self._kv is not None:
            lookup = await self._kv.lookup(parsed, model, pods)
            if lookup is not None:
                req.prompt_tokens = len(lookup.token_ids)
                req.block_keys = lookup.keys
        if getattr(strategy, "uses_prefix_hashes", False):
            if parsed.kind == "chat":
                req.prefix_hashes = chat_prefix_hashes(parsed.body["messages"])
            else:
                req.prefix_hashes = text_prefix_hashes(parsed.body.get("prompt"))
        if getattr(strategy, "uses_session", False):
            key = headers.get(self._session_header) or parsed.body.get(self._session_field)
            req.session_key = str(key) if key else None
        return req, lookup

    def pod_views(self, pods: Iterable[Pod]) -> list[PodView]:
        views = []
        for p in pods:
            load = self._load.get(p.name)
            views.append(
                PodView(
                    id=p.name,
                    in_flight=load.in_flight,
                    in_flight_prefill_tokens=load.prefill_tokens,
                    waiting=p.waiting,
                    running=p.running,
                    kv_usage=p.kv_usage,
                    prefilling=load.prefilling,
                )
            )
        return views

    def choose(
        self, req: RouteRequest, pods: list[Pod], match: PrefixMatch | None = None
    ) -> Decision:
        strategy = self.strategy_for(req.model)
        started = time.perf_counter()
        decision = strategy.choose(req, self.pod_views(pods), match, time.monotonic())
        self._metrics.decision_latency.labels(strategy.name).observe(time.perf_counter() - started)
        self._metrics.decisions.labels(strategy.name, decision.reason).inc()
        return decision

    def observe(self, req: RouteRequest, decision: Decision, outcome: Outcome) -> None:
        self.strategy_for(req.model).observe(req, decision, outcome)
