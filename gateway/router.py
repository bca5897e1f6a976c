"""The gateway side of routing: what a strategy needs from an HTTP request, and metrics.

The steps around a strategy call live in ``routing.core.RoutingCore``, shared with
the discrete-event simulator. Here the gateway supplies what only it has: the parsed
body (tokenized and looked up in the index by ``KvIndex`` when the strategy needs
it, hashed into prompt chunks, or searched for a session key), the registry's pods
with their scraped engine gauges, and the Prometheus metrics of each decision.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping

from gateway.apis import CACHE_ROUTED
from gateway.kv import KvIndex
from gateway.metrics import GatewayMetrics
from gateway.openai_body import ParsedRequest
from gateway.pods import Pod
from kvindex.keyer import root_key
from routing.core import Candidate, IndexAnswer, Routed, RoutingCore
from routing.prefix_hash import chat_prefix_hashes, text_prefix_hashes
from routing.types import Decision, Outcome, RouteRequest, Strategy

CHARS_PER_TOKEN = 4  # estimate until a tokenizer is configured for the model


class Router:
    def __init__(
        self,
        core: RoutingCore,
        metrics: GatewayMetrics,
        kv: KvIndex | None = None,
        session_header: str = "x-session-id",
        session_body_field: str = "user",
    ) -> None:
        self.core = core
        self._kv = kv
        self._metrics = metrics
        self.set_session_source(session_header, session_body_field)
        # Told (model, released) when a request's load drops: its prefill ended (False)
        # or it finished (True). Admission control wakes its waiters on it.
        self.on_load_change: Callable[[str, bool], None] | None = None
        # With sibling workers (``gateway.siblings``): called before a request is routed
        # (to apply what they told since) and with every decision (to tell them).
        self.before_route: Callable[[], object] | None = None
        self.on_routed: Callable[[Routed], None] | None = None
        # With load shared through Redis (``gateway.scale_out``): called before a
        # request is routed; what it returns is awaited after the index lookup, so the
        # other replicas' counts are read beside it, not after it.
        self.fresh_load: Callable[[], Awaitable[None] | None] | None = None

    def set_session_source(self, header: str, body_field: str) -> None:
        """Where the session strategy finds a request's session: this header, else this
        body field."""
        self._session_header = header.lower()
        self._session_field = body_field

    def strategy_for(self, model: str) -> Strategy:
        return self.core.strategy_for(model)

    def uses_index(self, model: str) -> bool:
        """Whether requests for ``model`` are tokenized and looked up in the index."""
        return self._kv is not None and self.core.needs_index(model)

    async def prepare(
        self,
        parsed: ParsedRequest,
        model: str,
        request_id: str,
        headers: Mapping[str, str],
        pods: list[Pod],
    ) -> tuple[RouteRequest, IndexAnswer | None]:
        """Build what the model's strategy needs, and only that (tokens cost time)."""
        if self.before_route is not None:
            self.before_route()
        load_read = self.fresh_load() if self.fresh_load is not None else None
        answer = None
        cache_routed = parsed.kind in CACHE_ROUTED
        if cache_routed and self._kv is not None and self.core.needs_index(model):
            answer = await self._kv.lookup(parsed, model, pods)
        if load_read is not None:
            await load_read
        body = parsed.body

        def prefix_hashes() -> list[int]:
            if not cache_routed:
                return []  # embeddings, pooling, audio ...: load alone
            # Seeded like the engine's cache is partitioned: by model (an adapter is
            # its own) and salt, so a prompt under one never matches another's pods.
            salt = body.get("cache_salt")
            seed = root_key(model, None, salt if isinstance(salt, str) and salt else None)
            messages = parsed.messages
            if messages is not None:
                return chat_prefix_hashes(messages, seed=seed)
            return text_prefix_hashes(body.get("prompt"), seed=seed)

        def session_key() -> str | None:
            key = headers.get(self._session_header) or body.get(self._session_field)
            if isinstance(key, str):
                return key or None
            # A number names a session too; an object or array does not (no session).
            is_number = isinstance(key, int | float) and not isinstance(key, bool)
            return str(key) if is_number else None

        req = self.core.request(
            model,
            request_id=request_id,
            prompt_tokens=parsed.approx_prompt_chars() // CHARS_PER_TOKEN,
            stream=parsed.stream,
            index=answer,
            prefix_hashes=prefix_hashes,
            session_key=session_key,
        )
        return req, answer

    def route(
        self, req: RouteRequest, pods: list[Pod], answer: IndexAnswer | None, *, retry: bool = False
    ) -> Routed:
        """Choose among ``pods``; the chosen pod's load is counted before this returns.
        ``retry``: the request was routed before (its index answer's time counted then)."""
        started = time.perf_counter()
        candidates = [Candidate(p.name, p.engine) for p in pods]
        routed = self.core.route(req, candidates, answer.match if answer is not None else None)
        took_s = time.perf_counter() - started
        self._counted(routed, took_s if retry else took_s + _lookup_s(answer))
        return routed

    def decide(self, req: RouteRequest, pods: list[Pod], answer: IndexAnswer | None) -> Decision:
        """The strategy's choice among ``pods``, not yet acted on (admission weighs it)."""
        candidates = [Candidate(p.name, p.engine) for p in pods]
        return self.core.decide(req, candidates, answer.match if answer is not None else None)

    def commit(
        self, req: RouteRequest, decision: Decision, answer: IndexAnswer | None, took_s: float
    ) -> Routed:
        """Act on a ``decide`` that took ``took_s``: the pod's load is counted now."""
        routed = self.core.commit(req, decision, answer.match if answer is not None else None)
        self._counted(routed, took_s + _lookup_s(answer))
        return routed

    def _counted(self, routed: Routed, took_s: float) -> None:
        name = routed.strategy.name
        self._metrics.decision_latency.labels(name).observe(took_s)
        self._metrics.decisions.labels(name, routed.decision.reason).inc()
        self._metrics.dispatched(routed.pod, routed.request.model)
        if self.on_routed is not None:
            self.on_routed(routed)

    def response_started(self) -> None:
        """The client has the start of a response: what was deferred off the requests'
        way to their pods (the index's speculative entries) is written now."""
        if self._kv is not None:
            self._kv.flush_speculations()

    def first_token(self, routed: Routed) -> None:
        self.core.first_token(routed)
        if self.on_load_change is not None:
            self.on_load_change(routed.request.model, False)

    def learn_at_first_token(self, routed: Routed, ttft_s: float) -> None:
        """The strategy learns the request's TTFT now, if it learns at the first token
        (after the first byte went out: ``RoutingCore.learn_at_first_token``)."""
        self.core.learn_at_first_token(routed, ttft_s)

    def finish(self, routed: Routed, outcome: Outcome | None) -> None:
        """Release the load (once) and observe ``outcome`` (None: a retried attempt)."""
        if routed.inflight.finished:
            return
        self.core.finish(routed, outcome)
        self._metrics.released(routed.pod, routed.request.model)
        if self.on_load_change is not None:
            self.on_load_change(routed.request.model, True)


def _lookup_s(answer: IndexAnswer | None) -> float:
    return answer.lookup_s if answer is not None else 0.0
