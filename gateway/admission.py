"""Admission control in the gateway: priorities, per-tenant fairness, SLO shedding.

The decisions are ``routing.admission``'s (pure, shared with the simulator); this
module gives them what only the gateway has: who the request is (priority and tenant
from headers, API keys and config), the pods' in-flight load and the strategy's
preview of where the request would go (``Router.decide``), a future per waiting
request, and the metrics.

A waiting request holds nothing but its future. It is dispatched by ``_pump``, which
runs whenever a request of its model lets go of load (``Router.on_load_change``) or a
pod joins rotation, and commits the routing decision (counting the pod's load) before
the next waiter is probed. A client that leaves cancels its task (``DisconnectWatch``)
and so its wait; a wait longer than ``max_wait_s`` is a 429. Built only when
``admission.enabled``: otherwise the proxy never calls it.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.auth import presented_key
from gateway.config import AdmissionSettings, AdmissionTenant, ModelSettings, Settings
from gateway.errors import GatewayError
from gateway.metrics import CachedLabels, forget_series
from gateway.pods import Pod
from gateway.router import Router
from kvindex.types import Bound
from routing.admission import (
    SHED_REASONS,
    AdmissionPolicy,
    AdmissionQueue,
    Offer,
    Ticket,
    Verdict,
)
from routing.core import IndexAnswer, Routed
from routing.types import Decision, RouteRequest

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TENANT_CHARS = 128  # a tenant header's value is cut to this


class AdmissionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_length = CachedLabels(
            Gauge(
                "kvgate_admission_queue_length",
                "Requests waiting at the gateway for a pod, by model and priority.",
                ["model", "priority"],
                registry=registry,
                multiprocess_mode="livesum",  # --workers: what waits on the whole host
            )
        )
        self.wait = CachedLabels(
            Histogram(
                "kvgate_admission_wait_seconds",
                "Time a dispatched request waited at the gateway (0: it went at once).",
                ["model", "priority"],
                buckets=_WAIT_BUCKETS,
                registry=registry,
            )
        )
        self.shed = CachedLabels(
            Counter(
                "kvgate_admission_shed",
                "Requests answered 429 by admission control, by reason "
                "(queue_full, slo, queue_timeout).",
                ["model", "priority", "reason"],
                registry=registry,
            )
        )


@dataclass(slots=True)
class _Waiter:
    """What the pump needs to route a waiting request, and where it hands the result."""

    future: asyncio.Future[Routed]
    request: RouteRequest
    answer: IndexAnswer | None
    candidates: Callable[[], list[Pod]]


def policy_of(s: AdmissionSettings, m: ModelSettings) -> AdmissionPolicy:
    """A model's admission policy: its own limits and SLO where set, else the global
    ones. Raises ValueError for values the settings accept but a policy does not."""
    limit, queue = m.max_in_flight_per_pod, m.max_prefilling_per_pod
    slo_ms = m.ttft_slo_ms if m.ttft_slo_ms is not None else s.ttft_slo_ms
    return AdmissionPolicy(
        max_in_flight_per_pod=limit if limit is not None else s.max_in_flight_per_pod,
        max_prefilling_per_pod=queue if queue is not None else s.max_prefilling_per_pod,
        max_queue=s.max_queue,
        max_wait_s=s.max_wait_s,
        ttft_slo_s=slo_ms / 1000 if slo_ms is not None else None,
        slo_action=s.slo_action,
        priorities=len(s.priorities),
        max_tenants=s.max_tenants,
    )


def check_admission(settings: Settings) -> None:
    """Build the admission policy of every configured model, and the default one any
    other model gets, as the running admission control will at each model's first
    request: a value the settings accept but a policy does not (a ``ttft_slo_ms`` so
    small that in seconds it is 0) raises ValueError naming where, at start-up and in
    a reload's validation (in ``Gateway.reconfigure`` it would leave the gateway half
    reconfigured; at a request, fail the model's every request)."""
    if not settings.admission.enabled:
        return
    for model in [*settings.models, ""]:  # "": a model with no settings of its own
        try:
            policy_of(settings.admission, settings.models.get(model) or ModelSettings())
        except ValueError as exc:
            where = f"models.{model}" if model in settings.models else "admission"
            raise ValueError(f"{where}: {exc}") from None


class Admission:
    """One gateway's admission control: a queue per model, fed and drained here."""

    def __init__(
        self,
        settings: AdmissionSettings,
        models: Mapping[str, ModelSettings],
        router: Router,
        metrics: AdmissionMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._router = router
        self._metrics = metrics
        self._clock = clock
        self._queues: dict[str, AdmissionQueue] = {}  # one per model the pods serve
        self._leaving: set[str] = set()  # models no pod serves, whose queues still hold waiters
        self._configure(settings, models)

    def _configure(self, settings: AdmissionSettings, models: Mapping[str, ModelSettings]) -> None:
        self._s = settings
        self._models = models
        self._levels = {name: i for i, name in enumerate(settings.priorities)}
        self._default_level = self._levels[settings.default_priority]
        self._by_key = {k: t for t in settings.tenants for k in t.api_keys}
        self._by_name = {t.name: t for t in settings.tenants}
        self._policies: dict[str, AdmissionPolicy] = {}
        self._router.on_load_change = self._load_changed

    def reconfigure(self, settings: AdmissionSettings, models: Mapping[str, ModelSettings]) -> None:
        """New settings (a configuration reload): requests that arrive from now on get
        the new tenants, priorities and limits; waiting ones keep their place in line
        (their priority by name; a name that is gone becomes the default priority) and
        go as soon as the new limits allow."""
        old = self._s.priorities
        self._configure(settings, models)
        levels = {i: self._levels.get(name, self._default_level) for i, name in enumerate(old)}
        moved = levels if any(i != level for i, level in levels.items()) else None
        for model, queue in self._queues.items():
            queue.set_policy(self._policy(model), moved)
            for gone in set(old) - set(settings.priorities):
                self._metrics.queue_length.labels(model, gone).set(0)
            self._gauge(model)
            self._pump(model)

    def release_all(self) -> None:
        """Admission control was switched off (a reload): every waiting request goes
        now, whatever the limits, and no request that arrives later waits."""
        unlimited = self._s.model_copy(update={"max_in_flight_per_pod": 0,
            "max_prefilling_per_pod": 0, "ttft_slo_ms": None, "slo_action": "shed"})  # fmt: skip
        self.reconfigure(unlimited, {})
        self._router.on_load_change = None  # nothing waits: no pump needed

    # -- the proxy's calls --------------------------------------------------------------

    def ticket(self, headers: Mapping[str, str], arrived: float) -> Ticket:
        """Priority, tenant, weight and SLO of a request (400 on a bad header)."""
        tenant_id, tenant = self._tenant(headers)
        level = self._default_level
        ceiling = 0 if self._s.trust_priority_header else level
        if tenant is not None and tenant.priority is not None:
            level = ceiling = self._levels[tenant.priority]
        asked = headers.get(self._s.priority_header)
        if asked is not None:
            if asked not in self._levels:
                known = ", ".join(self._s.priorities)
                message = f"{self._s.priority_header} must be one of {known}"
                raise GatewayError(400, message, code="invalid_priority")
            level = max(self._levels[asked], ceiling)
        weight = tenant.weight if tenant is not None else 1.0
        return Ticket(arrived, level, tenant_id, weight=weight, slo_s=self._slo_header(headers))

    async def admit(
        self,
        model: str,
        ticket: Ticket,
        req: RouteRequest,
        answer: IndexAnswer | None,
        candidates: Callable[[], list[Pod]],
        reveal_predictions: bool = False,
    ) -> Routed | None:
        """The request's routed dispatch once admitted (its pod's load counted); None
        when no pod serves the model (the proxy answers 503). Raises 429 when shed.
        ``reveal_predictions``: the caller may see predicted TTFTs (as in the
        ``x-kvgate-predicted-*`` headers), so an SLO shed may say how far over it was."""
        if not candidates():
            return None
        if self._leaving:  # a pod serves the model again: its queue stays
            self._leaving.discard(model)
        queue = self._queue(model)
        waiter = _Waiter(asyncio.get_running_loop().create_future(), req, answer, candidates)
        ticket.item = waiter
        verdict = queue.arrive(ticket, self._clock(), self._probe)
        if verdict.kind == "dispatch":
            return self._commit(model, ticket, verdict)
        if verdict.kind == "shed":
            raise self._shed(model, ticket, verdict, reveal_predictions)
        self._gauge(model)
        try:
            async with asyncio.timeout(queue.policy.max_wait_s):
                return await waiter.future
        except TimeoutError:
            if waiter.future.done() and not waiter.future.cancelled():
                return waiter.future.result()  # dispatched as the timer fired
            late = queue.time_out(ticket)
            assert late is not None
            raise self._shed(model, ticket, late) from None
        except asyncio.CancelledError:  # the client left (or the server stops)
            if not queue.cancel(ticket) and waiter.future.done() and not waiter.future.cancelled():
                self._router.finish(waiter.future.result(), None)  # dispatched meanwhile
            raise
        finally:
            self._gauge(model)
            self._pump(model)  # the head may have changed
            if model in self._leaving and not queue.waiting:
                self._forget(model)  # the last waiter of a model that left

    def pod_admitted(self, pod: Pod) -> None:
        """A pod joined rotation: waiters of its models may go now."""
        for model in list(self._queues):
            if model in pod.models:
                self._pump(model)

    def models_gone(self, gone: set[str]) -> None:
        """No pod serves ``gone`` any more (``PodRegistry.on_models_gone``): their queues
        and series go, the model's fairness state with them. A queue with waiters stays
        until the last has gone (dispatched, shed or cancelled: counted in its series)."""
        for model in gone:
            queue = self._queues.get(model)
            if queue is not None and queue.waiting:
                self._leaving.add(model)
            else:
                self._forget(model)

    def bounds(self) -> dict[str, Bound]:
        out: dict[str, Bound] = {}
        for model, queue in self._queues.items():
            for name, bound in queue.bounds().items():
                out[f"admission.{model}.{name}"] = bound
        return out

    # -- inside ---------------------------------------------------------------------------

    def _tenant(self, headers: Mapping[str, str]) -> tuple[str, AdmissionTenant | None]:
        """(the fair-queueing id, the configured tenant or None)."""
        if self._s.tenant_source == "header":
            name = headers.get(self._s.tenant_header, "")[:_TENANT_CHARS]
            tenant = self._by_name.get(name)
            return name, tenant
        token = presented_key(headers)  # as the client key is checked: bearer or x-api-key
        if token is None:
            return "", None
        tenant = self._by_key.get(token)
        if tenant is not None:
            return tenant.name, tenant
        # An unconfigured key is a tenant of its own; its id is a digest, not the secret.
        return "key:" + hashlib.blake2b(token.encode(), digest_size=8).hexdigest(), None

    def _slo_header(self, headers: Mapping[str, str]) -> float | None:
        raw = headers.get(self._s.slo_header)
        if raw is None:
            return None
        try:
            ms = float(raw)
        except ValueError:
            ms = -1.0
        if not 0 < ms < 1e9:
            raise GatewayError(400, f"{self._s.slo_header} must be a positive number of "
                               "milliseconds", code="invalid_slo")  # fmt: skip
        return ms / 1000

    def _policy(self, model: str) -> AdmissionPolicy:
        policy = self._policies.get(model)
        if policy is None:
            m = self._models.get(model) or ModelSettings()
            policy = self._policies[model] = policy_of(self._s, m)
        return policy

    def _queue(self, model: str) -> AdmissionQueue:
        queue = self._queues.get(model)
        if queue is None:  # model names are the pods' (checked by the proxy): bounded
            queue = self._queues[model] = AdmissionQueue(self._policy(model))
            self._gauge(model)  # every priority's series, from the model's first request
        return queue

    def _probe(self, ticket: Ticket) -> Offer:
        """Where the request would go now, and whether that pod has room for it."""
        waiter = ticket.item
        assert isinstance(waiter, _Waiter)
        pods = waiter.candidates()
        if not pods:
            return Offer(False)
        load = self._router.core.load
        policy = self._policy(waiter.request.model)
        free = [p for p in pods if policy.has_room(load.get(p.name))]
        started = time.perf_counter()
        decision = self._router.decide(waiter.request, free or pods, waiter.answer)
        took = time.perf_counter() - started
        idle = load.get(decision.pod).in_flight == 0
        return Offer(bool(free), decision.predicted_ttft_s, idle, (decision, took))

    def _commit(self, model: str, ticket: Ticket, verdict: Verdict) -> Routed:
        waiter = ticket.item
        assert isinstance(waiter, _Waiter)
        decision, took = verdict.decision  # type: ignore[misc]
        assert isinstance(decision, Decision)
        routed = self._router.commit(waiter.request, decision, waiter.answer, took)
        routed.waited_s = max(0.0, self._clock() - ticket.arrived)
        priority = self._s.priorities[ticket.priority]
        self._metrics.wait.labels(model, priority).observe(routed.waited_s)
        return routed

    def _shed(
        self, model: str, ticket: Ticket, verdict: Verdict, reveal_predictions: bool = False
    ) -> GatewayError:
        reason = verdict.reason
        assert reason in SHED_REASONS
        self._metrics.shed.labels(model, self._s.priorities[ticket.priority], reason).inc()
        retry_after = verdict.retry_after_s
        slo = "the predicted time to first token exceeds the request's SLO"
        if reveal_predictions:
            slo = (f"predicted time to first token ({(verdict.predicted_ttft_s or 0) * 1000:.0f}"
                   " ms) exceeds the request's SLO")  # fmt: skip
        elif reason == "slo":
            # An SLO shed's Retry-After is the predicted overshoot, which tells a caller
            # without predictions how much of its prompt is cached: not from here.
            retry_after = 1
        messages = {
            "queue_full": f"too many requests waiting for model '{model}'",
            "slo": slo,
            "queue_timeout": f"no pod had room for the request within "
            f"{self._policy(model).max_wait_s:g} s",
        }
        return GatewayError(429, messages[reason], code=reason,
                            headers={"retry-after": str(retry_after)})  # fmt: skip

    def _load_changed(self, model: str, released: bool) -> None:
        """A request's prefill ended or it finished: a pod may have room now."""
        self._pump(model)

    def _pump(self, model: str) -> None:
        """Dispatch waiters, head first, while the head may go."""
        queue = self._queues.get(model)
        if queue is None or not queue.waiting:
            return
        moved = False
        while (head := queue.head()) is not None:
            waiter = head.item
            assert isinstance(waiter, _Waiter)
            if waiter.future.done():  # its task was cancelled and has not run yet
                queue.cancel(head)
                continue
            ready = queue.next_ready(self._clock(), self._probe)
            if ready is None:
                break
            ticket, verdict = ready
            waiter.future.set_result(self._commit(model, ticket, verdict))
            moved = True
        if moved:
            self._gauge(model)

    def _forget(self, model: str) -> None:
        self._leaving.discard(model)
        self._queues.pop(model, None)
        self._policies.pop(model, None)
        m = self._metrics
        forget_series((m.queue_length, m.wait, m.shed), "model", model)

    def _gauge(self, model: str) -> None:
        queue = self._queues.get(model)
        if queue is None:  # forgotten: its model left, and another waiter was its last
            return
        for name, n in zip(self._s.priorities, queue.lengths(), strict=True):
            self._metrics.queue_length.labels(model, name).set(n)
