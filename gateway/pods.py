"""Upstream pods: health probing, ejection/readmission, models and engine load.

A pod is ejected after N consecutive failed probes or M consecutive failed
requests and readmitted after K consecutive successful probes. Each probe also
learns the pod's models from ``/v1/models`` (the served model and its LoRA
adapters: cards with a ``parent``; at most ``lora.max_models_per_pod``) and scrapes
the engine's queue from ``/metrics`` (``vllm:num_requests_waiting`` and friends)
for the load view. Adapters come and go at runtime (vLLM's
``/v1/load_lora_adapter``), so ``/v1/models`` is also re-read between probes: when
a request names a model no pod lists (``refresh_models``, at most once per
``lora.refresh_min_interval_s``) and when a pod answers 404 (``models_stale``).

The same scrape says when a pod restarted between two probes (a container restart
faster than an ejection): ``process_start_time_seconds`` moved later. Its prefix cache
is then empty, so the admit listeners run again (``Pod.restarts`` tells them why) and
the KV index forgets the old process's entries at once, not when the idle new process
first publishes an event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import msgspec

from gateway.config import HealthSettings, LoraSettings, PodConfig
from gateway.metrics import GatewayMetrics
from kvindex.bounded_http import send_capped
from kvindex.types import Bound
from routing.core import IDLE_ENGINE, EngineLoad

log = logging.getLogger("kvgate.pods")
T = TypeVar("T")

PodListener = Callable[["Pod"], Awaitable[None] | None]
RemovalListener = Callable[[str], Awaitable[None] | None]
ModelsListener = Callable[[set[str]], None]

# One /v1/models card as kept: the fields below, strings of up to CARD_STRING_CHARS
# (tracemalloc, CPython 3.11).
MODEL_CARD_BYTES = 1_300
# What is kept of a card: OpenAI's model object and vLLM's additions that say what the
# model is. The rest (vLLM's "permission" list, anything a pod adds) is dropped, so a
# card costs what MODEL_CARD_BYTES says whatever the pod sends.
CARD_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len")
CARD_STRING_CHARS = 256

# A probe's answers are read whole within probe_timeout_s, up to this many bytes each: a
# vLLM /metrics with its histograms and many adapters is some hundreds of KB.
MAX_PROBE_BODY_BYTES = 4 * 1024 * 1024
# Scraped queue lengths and block counts above this are a pod's garbage, not its load
# (nothing runs a million requests); clamped so that routing's arithmetic stays finite.
MAX_SCRAPED_VALUE = 1e6

_SCRAPED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # name before vLLM 0.10
}


@dataclass
class Pod:
    config: PodConfig
    healthy: bool = False
    ever_probed: bool = False
    models: set[str] = field(default_factory=set)
    model_cards: dict[str, dict[str, object]] = field(default_factory=dict)
    failed_probes: int = 0
    failed_requests: int = 0
    good_probes: int = 0
    engine: EngineLoad = IDLE_ENGINE  # queue gauges scraped from the pod's /metrics
    last_probe: float = 0.0
    # When the pod's serving process started (its /metrics), the latest seen; None
    # until a scrape shows one. ``restarts`` counts the moves to a later start.
    process_start: float | None = None
    restarts: int = 0

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return self.config.url

    def parent_of(self, model: str) -> str | None:
        """The base model of a LoRA adapter this pod serves (None: not an adapter here)."""
        parent = (self.model_cards.get(model) or {}).get("parent")
        return parent if isinstance(parent, str) and parent else None

    @property
    def engine_model(self) -> str | None:
        """The model the engine itself serves, which its KV events are keyed by (LoRA
        adapters list a ``parent``; the first base model by name if it lists several)."""
        cards = self.model_cards
        bases = [m for m in sorted(self.models) if not (cards.get(m) or {}).get("parent")]
        return bases[0] if bases else None


def same_endpoints(a: PodConfig, b: PodConfig) -> bool:
    """Whether two configs of a pod name one engine: its address and event endpoints."""
    return (a.url, a.kv_events, a.kv_replay, a.dp_ranks) == (
        b.url, b.kv_events, b.kv_replay, b.dp_ranks)  # fmt: skip


# prometheus_client's process collector, which vLLM's API server exports (0.32, one
# API server; with --api-server-count > 1 or PROMETHEUS_MULTIPROC_DIR set, its
# multiprocess registry has none, and a restart shows at its first event). Fixed for
# the life of a process (boot time is read once), unlabelled, and only the pod itself
# writes it: a client cannot fake a restart with it, nor does a reconnect move it.
_PROCESS_START = re.compile(rb"^process_start_time_seconds ([0-9.eE+]{1,32})\r?$", re.MULTILINE)
_CACHE_INFO = "vllm:cache_config_info"
_GPU_BLOCKS = re.compile(r'[{,]num_gpu_blocks="(\d{1,12})"')
_json = msgspec.json.Decoder()


def parse_engine_load(text: str) -> dict[str, float]:
    """Sum the scraped vLLM gauges over their label sets (one per engine), and the L0
    size in blocks (``kv_blocks``) from the ``num_gpu_blocks`` label of each engine's
    ``vllm:cache_config_info``. Values that are not finite or not within
    [0, ``MAX_SCRAPED_VALUE``] are skipped or clamped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == _CACHE_INFO:
            blocks = _GPU_BLOCKS.search(line)
            if blocks is not None:
                out["kv_blocks"] = out.get("kv_blocks", 0.0) + int(blocks.group(1))
            continue
        attr = _SCRAPED.get(name)
        if attr is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            out[attr] = out.get(attr, 0.0) + max(0.0, value)
    return {name: min(value, MAX_SCRAPED_VALUE) for name, value in out.items()}


def parse_process_start(body: bytes) -> float | None:
    """The pod's ``process_start_time_seconds`` (the latest, if it lists several), or
    None without a positive finite one. One regex pass: the body may be hundreds of KB."""
    starts = [s for s in map(_float_or_nan, _PROCESS_START.findall(body))
              if math.isfinite(s) and s > 0]  # fmt: skip
    return max(starts) if starts else None


def _float_or_nan(text: bytes) -> float:
    """``text`` as a float; NaN for what the regex lets through but is no number
    ("1.2.3", "e"): a pod's garbled line is ignored, it must not fail the probe."""
    try:
        return float(text)
    except ValueError:
        return math.nan


def saw_restart(pod: Pod, started: float | None) -> bool:
    """Record a scraped process start; True if it shows a new process since the last.

    Only a later start counts, and the latest is kept: a URL that reaches two
    processes in turn (a Service in front of replicas) counts once, not every probe.
    The first start seen is no restart: whatever the pod held then is what its event
    stream is (re)played from."""
    known = pod.process_start
    if started is None or (known is not None and started <= known):
        return False
    pod.process_start = started
    if known is None:
        return False
    pod.restarts += 1
    return True


def kept_card(card: dict[str, Any]) -> dict[str, object] | None:
    """What is kept of a pod's model card (``CARD_FIELDS``, scalars, strings of up to
    ``CARD_STRING_CHARS``); None for a card without a usable ``id``."""
    kept: dict[str, object] = {}
    for name in CARD_FIELDS:
        value = card.get(name)
        if isinstance(value, str) and len(value) <= CARD_STRING_CHARS:
            kept[name] = value
        elif type(value) is int and 0 <= value < 2**63:
            kept[name] = value
        elif value is None and name in card:  # vLLM's "parent": null of a base model
            kept[name] = None
    return kept if kept.get("id") else None


class PodRegistry:
    def __init__(
        self,
        pods: list[PodConfig],
        client: httpx.AsyncClient,
        health: HealthSettings,
        metrics: GatewayMetrics,
        lora: LoraSettings | None = None,
    ) -> None:
        self._client = client
        self._health = health
        self._metrics = metrics
        self._lora = lora or LoraSettings()
        self._pods: dict[str, Pod] = {}
        self._task: asyncio.Task[None] | None = None
        self._refresh: asyncio.Future[None] | None = None  # the re-read in flight, shared
        self._refreshed_at = -float("inf")
        self._stale: dict[str, asyncio.Task[None]] = {}  # one re-read per pod at a time
        self._stale_at: dict[str, float] = {}  # ... and at most one per interval
        self._over_capacity_logged: set[str] = set()
        self._on_eject: list[PodListener] = []
        self._on_lost: list[PodListener] = []
        self._on_admit: list[PodListener] = []
        self._on_remove: list[RemovalListener] = []
        self._on_models_gone: list[ModelsListener] = []
        for cfg in pods:
            self.add(cfg)

    # -- membership (static config now; discovery adds and removes later) --

    def add(self, cfg: PodConfig) -> Pod:
        pod = Pod(config=cfg, models=set(cfg.models))
        self._pods[cfg.name] = pod
        self._metrics.pod_healthy.labels(cfg.name).set(0)
        return pod

    def update(self, cfg: PodConfig) -> Pod | None:
        """The same pod (name, address and event endpoints) with other credentials or
        configured models (a configuration reload): it keeps its health, load and
        index entries; requests from now on use the new settings."""
        pod = self._pods.get(cfg.name)
        if pod is not None:
            pod.config = cfg
            self._set_models(pod, set(pod.model_cards) | set(cfg.models))
        return pod

    def configure(self, health: HealthSettings, lora: LoraSettings) -> None:
        """New health and model-listing settings (a reload); the next probe round uses them."""
        self._health = health
        self._lora = lora

    async def remove(self, name: str) -> None:
        """The pod left the fleet (discovery): out of rotation, then removal listeners."""
        pod = self._pods.pop(name, None)
        self._stale_at.pop(name, None)
        self._over_capacity_logged.discard(name)
        if pod is not None and pod.healthy:
            pod.healthy = False
            await self._notify(self._on_eject, pod)
        with contextlib.suppress(KeyError):
            self._metrics.pod_healthy.remove(name)
        if pod is not None:
            await self._notify(self._on_remove, name)
            self._models_lost(pod.models)

    def on_eject(self, listener: PodListener) -> None:
        """Called when a pod leaves rotation (failed probes or requests, or removal)."""
        self._on_eject.append(listener)

    def on_lost(self, listener: PodListener) -> None:
        """Called, after the ejection listeners, when a pod is ejected for failing its
        probes: it hung, died or cannot be reached, so what it is serving will likely
        never be answered (``gateway.awaiting``)."""
        self._on_lost.append(listener)

    def on_admit(self, listener: PodListener) -> None:
        """Called when a pod enters rotation."""
        self._on_admit.append(listener)

    def on_remove(self, listener: RemovalListener) -> None:
        """Called with the pod's name when it is removed from the fleet for good."""
        self._on_remove.append(listener)

    def on_models_gone(self, listener: ModelsListener) -> None:
        """Called with the models no pod lists any more (an adapter unloaded, the last
        pod of a model removed), as soon as that is seen: they are no longer
        ``known_models``. Synchronous: models are learnt outside any await."""
        self._on_models_gone.append(listener)

    # -- views --

    def get(self, name: str) -> Pod | None:
        return self._pods.get(name)

    def all(self) -> list[Pod]:
        return list(self._pods.values())

    def healthy_for(self, model: str) -> list[Pod]:
        """The healthy pods that serve ``model``. A name some pod serves as a base model
        is that base model (``kv.lora_of``): a pod listing it as an adapter of another
        model serves something else, and its events are keyed under its own base, so
        sending it there gets another model and a prediction that never matches (was:
        predicted 0, cached 304). One pass: this runs for every request."""
        serving: list[tuple[Pod, bool]] = []  # (healthy pod, lists it as an adapter)
        served_as_base = False
        for p in self._pods.values():
            if model in p.models:
                adapter = p.parent_of(model) is not None
                served_as_base = served_as_base or not adapter
                if p.healthy:
                    serving.append((p, adapter))
        return [p for p, adapter in serving if not (adapter and served_as_base)]

    def known_models(self) -> set[str]:
        models: set[str] = set()
        for p in self._pods.values():
            models |= p.models
        return models

    def bounds(self) -> dict[str, Bound]:
        """The model cards kept of each pod (``/admin/bounds``)."""
        cap = self._lora.max_models_per_pod
        return {f"model_cards[{p.name}]": Bound(len(p.model_cards), cap, "cards", MODEL_CARD_BYTES)
                for p in self._pods.values()}  # fmt: skip

    def serving_models(self) -> set[str]:
        models: set[str] = set()
        for p in self._pods.values():
            if p.healthy:
                models |= p.models
        return models

    # -- probing --

    async def start(self) -> None:
        await self.probe_all()
        self._task = asyncio.create_task(self._loop(), name="kvgate-health")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._refresh, *self._stale.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._health.interval_s)
            try:
                await self.probe_all()
            except Exception:  # a bug here must not stop health checking
                log.exception("health probe round failed")

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(p) for p in list(self._pods.values())))

    async def probe(self, pod: Pod) -> None:
        ok = await self._probe_once(pod)
        if self._pods.get(pod.name) is not pod:
            return  # removed (discovery) while the probe was in flight: do not re-admit
        pod.last_probe = time.monotonic()
        if ok:
            pod.failed_probes = 0
            pod.good_probes += 1
            # First contact admits at once; a pod that was ejected must prove itself.
            if not pod.healthy and (
                not pod.ever_probed or pod.good_probes >= self._health.readmit_after_successes
            ):
                await self._admit(pod)
        else:
            pod.good_probes = 0
            pod.failed_probes += 1
            if pod.healthy and pod.failed_probes >= self._health.eject_after_failed_probes:
                await self._eject(pod, "probe")
        pod.ever_probed = True

    async def _probe_once(self, pod: Pod) -> bool:
        engine_model = pod.engine_model
        try:
            ok, restarted = await self._probe_answers(pod)
        except Exception as exc:  # whatever a pod answers is a failed probe, never a stop
            log.debug("probe of %s failed: %r", pod.name, exc)
            ok, restarted = False, False
        # One notice for a restart and a model change (a restart under another name is
        # one re-follow), and for a model learnt even if /metrics then failed.
        await self._engine_changed(pod, engine_model, restarted)
        return ok

    async def _probe_answers(self, pod: Pod) -> tuple[bool, bool]:
        """(the pod is healthy, its process restarted since the last scrape)."""
        status, _ = await self._get(pod, "/health")
        if status != 200:
            return False, False
        status, body = await self._get(pod, "/v1/models")
        if status == 200:
            self._learn_models(pod, _json.decode(body))
        status, body = await self._get(pod, "/metrics")
        if status != 200:
            return True, False
        load = parse_engine_load(body.decode("utf-8", "replace"))
        pod.engine = EngineLoad(
            waiting=int(load.get("waiting", 0)),
            running=int(load.get("running", 0)),
            kv_usage=float(load.get("kv_usage", 0.0)),
            kv_capacity_blocks=int(load.get("kv_blocks", 0)),
        )
        return True, saw_restart(pod, parse_process_start(body))

    async def _get(self, pod: Pod, path: str) -> tuple[int, bytes]:
        """A pod's answer to ``GET path``: read whole within ``probe_timeout_s`` in all
        (else a pod dripping bytes would hold the probe, and the round of every pod's
        probes) and up to ``MAX_PROBE_BODY_BYTES``."""
        timeout = self._health.probe_timeout_s
        headers = {"Authorization": f"Bearer {pod.config.api_key}"} if pod.config.api_key else {}
        request = self._client.build_request("GET", f"{pod.url}{path}", headers=headers,
                                             timeout=timeout)  # fmt: skip
        return await send_capped(self._client, request, MAX_PROBE_BODY_BYTES, timeout)

    def _learn_models(self, pod: Pod, listing: Any) -> None:
        """The pod's model cards, the first ``max_models_per_pod`` of them."""
        cap = self._lora.max_models_per_pod
        cards: dict[str, dict[str, object]] = {}
        data = listing.get("data") if isinstance(listing, dict) else None
        for card in data if isinstance(data, list) else []:
            kept = kept_card(card) if isinstance(card, dict) else None
            if kept is None:
                continue
            if len(cards) < cap:
                cards[str(kept["id"])] = kept
            elif len(cards) >= cap and pod.name not in self._over_capacity_logged:
                self._over_capacity_logged.add(pod.name)
                log.warning("pod %s lists more than %d models; the rest are ignored",
                            pod.name, cap)  # fmt: skip
        pod.model_cards = cards
        self._set_models(pod, set(cards) | set(pod.config.models))

    async def _learn_models_and_notify(self, pod: Pod, listing: Any) -> None:
        """``_learn_models``, then ``_engine_changed`` if the base model changed."""
        before = pod.engine_model
        self._learn_models(pod, listing)
        await self._engine_changed(pod, before, restarted=False)

    async def _engine_changed(self, pod: Pod, model_before: str | None, restarted: bool) -> None:
        """The admit listeners again for a pod in rotation whose engine changed under it
        between two probes, so was never ejected: restarted (``saw_restart``: its cache
        is empty, but the index holds the old process's entries until the new one
        publishes an event, which an idle pod may not do for hours), or serving another
        base model (restarted under another ``--served-model-name``: its events were
        keyed by the old model, so the new model's prefixes never matched).
        ``KvIndex.pod_admitted`` forgets the pod's entries and follows its events anew."""
        now = pod.engine_model
        model_changed = model_before is not None and now != model_before
        if not pod.healthy or not (restarted or model_changed):
            return
        if model_changed:
            log.info("pod %s now serves %s (was %s)", pod.name, now, model_before)
        if restarted:
            log.warning("pod %s restarted between probes (process started at %.2f): its "
                        "cache is empty", pod.name, pod.process_start or 0.0)  # fmt: skip
        await self._notify(self._on_admit, pod)

    def _set_models(self, pod: Pod, models: set[str]) -> None:
        lost, pod.models = pod.models - models, models
        self._models_lost(lost)

    def _models_lost(self, lost: set[str]) -> None:
        """A pod no longer lists ``lost``: those no pod lists are gone from the fleet.
        Only the pod's own models are checked, against the others' (the fleet's
        ``known_models`` before and after, without building it every probe)."""
        pods = self._pods.values()
        gone = {m for m in lost if not any(m in p.models for p in pods)}
        if not gone:
            return
        log.info("models no pod serves any more: %s", ", ".join(sorted(gone)))
        for listener in self._on_models_gone:
            try:
                listener(gone)
            except Exception:
                log.exception("models listener failed for %s", ", ".join(sorted(gone)))

    async def _read_models(self, pod: Pod) -> None:
        try:
            status, body = await self._get(pod, "/v1/models")
            if status == 200:
                await self._learn_models_and_notify(pod, _json.decode(body))
        except Exception as exc:  # the next probe tells whether the pod is still there
            log.debug("reading the models of %s failed: %r", pod.name, exc)

    async def refresh_models(self) -> None:
        """Re-read the healthy pods' models now, unless that was done less than
        ``refresh_min_interval_s`` ago; concurrent callers share one re-read."""
        if self._refresh is None:
            now = time.monotonic()
            if now - self._refreshed_at < self._lora.refresh_min_interval_s:
                return
            self._refreshed_at = now
            pods = [p for p in self._pods.values() if p.healthy]
            self._refresh = asyncio.ensure_future(
                asyncio.gather(*(self._read_models(p) for p in pods))
            )
            self._refresh.add_done_callback(lambda _: setattr(self, "_refresh", None))
        await asyncio.shield(self._refresh)

    def models_stale(self, pod: Pod) -> None:
        """A pod's answer says its model list changed (a 404): re-read it soon."""
        now = time.monotonic()
        if pod.name in self._stale or self._pods.get(pod.name) is not pod:
            return
        if now - self._stale_at.get(pod.name, -float("inf")) < self._lora.refresh_min_interval_s:
            return
        self._stale_at[pod.name] = now
        task = asyncio.get_running_loop().create_task(self._read_models(pod))
        self._stale[pod.name] = task
        task.add_done_callback(lambda _: self._stale.pop(pod.name, None))

    # -- request outcomes --

    async def request_failed(self, pod: Pod) -> None:
        pod.failed_requests += 1
        if pod.healthy and pod.failed_requests >= self._health.eject_after_failed_requests:
            await self._eject(pod, "requests")

    def request_succeeded(self, pod: Pod) -> None:
        pod.failed_requests = 0

    async def _eject(self, pod: Pod, cause: str) -> None:
        pod.healthy = False
        pod.good_probes = 0
        log.warning("pod %s ejected (%s)", pod.name, cause)
        self._metrics.pod_healthy.labels(pod.name).set(0)
        self._metrics.pod_ejections.labels(pod.name, cause).inc()
        await self._notify(self._on_eject, pod)
        if cause == "probe":
            await self._notify(self._on_lost, pod)

    async def _admit(self, pod: Pod) -> None:
        pod.healthy = True
        pod.failed_requests = 0
        log.info("pod %s in rotation (models: %s)", pod.name, ", ".join(sorted(pod.models)))
        self._metrics.pod_healthy.labels(pod.name).set(1)
        await self._notify(self._on_admit, pod)

    @staticmethod
    async def _notify(listeners: list[Callable[[T], Awaitable[None] | None]], arg: T) -> None:
        for listener in listeners:
            try:
                result = listener(arg)
                if result is not None:
                    await result
            except Exception:
                log.exception("pod listener failed for %s", getattr(arg, "name", arg))
