"""The gateway's view of what is cached where.

Glue between the service and ``kvindex``: per-model tokenization
(``gateway.prompt_tokens``) and block keys,
the index store (embedded memory, or Redis shared by replicas with a local
fallback), one KV-event subscriber per pod, and HTTP event ingestion. Routing
asks ``lookup`` for a request's token ids, keys and ``PrefixMatch``.

A LoRA adapter is served by its base model's engine: its prompts are tokenized and
blocked like the base model's (its settings), and keyed under the base model with
the adapter's name in the chain's root, exactly as the engine's ``BlockStored``
events for it carry ``lora_name``, so an adapter's cache never counts as the base
model's, nor the other way round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Coroutine, Iterable, Sequence
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry, Counter

from gateway.config import ModelSettings, Settings
from gateway.openai_body import ParsedRequest
from gateway.pods import Pod
from gateway.prompt_tokens import PromptTokens
from gateway.tracing import span
from kvindex.deferred import DeferredSpeculations
from kvindex.events.http_ingest import decode_http_events
from kvindex.events.ingest import PodIngestor
from kvindex.events.subscriber import KVEventSubscriber
from kvindex.events.types import EngineBatch
from kvindex.instrumented import InstrumentedStore
from kvindex.keyer import BlockKeyer, KeyerCaches
from kvindex.lru import BoundedLRU
from kvindex.memory_store import MemoryStore
from kvindex.metrics import EventMetrics, forget_label_value, label_values
from kvindex.store import IndexStore
from kvindex.tokenization.front import Tokenization
from kvindex.types import Bound
from routing.core import IndexAnswer

log = logging.getLogger("kvgate.kv")


# Speculative writes to a shared index (Redis) run in the background; beyond this many
# pending, new ones are dropped (the local view still has them): a slow Redis must not
# grow a task per request without bound.
MAX_PENDING_SPECULATIONS = 1024
# Keyers kept, one per model keyed (pods choose the models). What a keyer remembers is in
# one shared ``KeyerCaches``, so a keyer is a few hundred bytes and one that falls out
# is made again at no more cost than hashing its root.
MAX_KEYERS = 4096
KEYER_BYTES = 600  # a BlockKeyer, its model name and its LRU node (tracemalloc)
# Dispatched prompts whose speculative entries wait for the next lookup or for their
# response to start (``KvIndex.speculate``); more than this and they are written at once.
MAX_DEFERRED_SPECULATIONS = 256


def build_store(
    settings: Settings, prometheus: CollectorRegistry, writes_events: bool = True
) -> IndexStore:
    """The index store: memory, or Redis with a local view. ``writes_events=False``: a
    sibling worker writes this host's KV events to Redis (``gateway.workers``); this one
    keeps them in its local view only."""
    idx = settings.index
    local = MemoryStore(idx.capacity_keys)
    if idx.backend == "memory":
        return InstrumentedStore(local, prometheus)
    from kvindex.redis_store import RedisStore
    from kvindex.resilient_store import ResilientMetrics, ResilientStore

    if not idx.redis_url:
        raise ValueError("index.backend is 'redis' but index.redis_url is not set")
    redis: Any = RedisStore(
        idx.redis_url, namespace=idx.namespace, key_ttl_s=idx.key_ttl_s,
        max_keys=idx.capacity_keys, cluster=idx.redis_cluster,
    )  # fmt: skip
    if not writes_events:
        from gateway.siblings import EventsWrittenElsewhere

        redis = EventsWrittenElsewhere(redis)
    resilient = ResilientStore(redis, local, ResilientMetrics(prometheus))
    return InstrumentedStore(resilient, prometheus)


class KvIndex:
    def __init__(
        self,
        settings: Settings,
        prometheus: CollectorRegistry,
        client: httpx.AsyncClient,
        writes_events: bool = True,
    ) -> None:
        self._s = settings
        store = build_store(settings, prometheus, writes_events)
        # Only an index in this process waits: a shared one is read by other replicas.
        self._deferring: DeferredSpeculations | None = None
        if settings.index.backend == "memory":
            self._deferring = DeferredSpeculations(store, MAX_DEFERRED_SPECULATIONS)
        self.store: IndexStore = self._deferring or store
        # Sibling worker processes (``gateway.siblings``): what only this worker learns.
        self.peers: IndexPeers | None = None
        self.event_metrics = EventMetrics(prometheus)
        self._tokenize_failures = Counter(
            "kvgate_tokenize_failures",
            "Requests routed without index lookup because tokenization failed.",
            ["model"],
            registry=prometheus,
        )
        self.tokens = PromptTokens(settings, client)
        self._keyer_caches = KeyerCaches()
        self._keyers: BoundedLRU[str, BlockKeyer] = BoundedLRU(MAX_KEYERS)
        self._subscribers: dict[str, KVEventSubscriber] = {}
        self._http_ingestors: dict[str, PodIngestor] = {}
        # Per followed pod, its ``Pod.restarts`` when following began: a higher count
        # now means the events (and entries) are of a process that is gone.
        self._followed_restarts: dict[str, int] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self.speculations_dropped = 0

    # -- per-model pieces --

    def model_settings(self, model: str) -> ModelSettings:
        return self._s.models.get(model) or ModelSettings()

    def block_size(self, model: str) -> int:
        return self.model_settings(model).block_size or self._s.default_block_size

    def keyer(self, model: str) -> BlockKeyer:
        keyer = self._keyers.touch(model)
        if keyer is None:
            keyer = BlockKeyer(model, self.block_size(model), caches=self._keyer_caches)
            self._keyers.put(model, keyer)
        return keyer

    async def warm_up(self, models: Iterable[str]) -> None:
        """These models' tokenizers loaded before the gateway serves (``PromptTokens``)."""
        await self.tokens.warm_up(models)

    async def load_tokenizers(
        self, settings: Settings, warm: Iterable[str]
    ) -> dict[str, Tokenization]:
        """For a reload to ``settings``: the tokenizers that change, loaded in a thread."""
        return await self.tokens.load(settings, warm)

    def use_settings(self, settings: Settings, tokenizers: dict[str, Tokenization]) -> list[str]:
        """Take new settings (a reload) with the ``load_tokenizers`` made for them;
        return the pods whose KV events must be followed anew (``refollow``).

        A model whose block size changed gets a new keyer, and the index entries of its
        pods, keyed by the old block size, can never match a lookup again: ``refollow``
        drops them and follows those pods' events again (replayed from the pod's
        replay endpoint, where it has one). A new tokenizer leaves the index as it is:
        keys come from the engine's token ids."""
        self.tokens.use_settings(settings, tokenizers)
        self._s = settings
        ingestors = {**self._http_ingestors,
                     **{name: sub.ingestor for name, sub in self._subscribers.items()}}  # fmt: skip
        # An ingestor keeps the keyer it was made with, which may have left ``_keyers``.
        keyers = [*(self._keyers.get(m) for m in list(self._keyers)),
                  *(ing.keyer for ing in ingestors.values())]  # fmt: skip
        rekeyed = sorted({
            k.model for k in keyers if k is not None and k.block_size != self.block_size(k.model)
        })  # fmt: skip
        for model in rekeyed:
            self._keyers.pop(model)
        stale = sorted(p for p, ing in ingestors.items() if ing.keyer.model in rekeyed)
        if rekeyed:
            log.info("block size of %s changed: the index entries of %s are dropped and "
                     "their KV events followed anew", ", ".join(rekeyed),
                     ", ".join(stale) or "no pod")  # fmt: skip
        return stale

    async def refollow(self, pods: Iterable[Pod]) -> None:
        """Forget what the index holds of ``pods`` and follow their KV events again."""
        for pod in pods:
            self._http_ingestors.pop(pod.name, None)
            self._followed_restarts.pop(pod.name, None)
            sub = self._subscribers.pop(pod.name, None)
            if sub is not None:
                await sub.stop()
            await self.store.drop_pod(pod.name)
            if pod.healthy:
                await self.pod_admitted(pod)

    # -- requests --

    async def lookup(
        self, parsed: ParsedRequest, model: str, pods: list[Pod]
    ) -> IndexAnswer | None:
        """Tokenize like the engine, key the blocks, ask the store. None if not possible."""
        started = time.perf_counter()
        salt = parsed.body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        base, lora = lora_of(model, pods)
        try:
            with span("kvgate.tokenize"):
                token_ids = await self.tokens.token_ids(parsed, base, pods)
                if token_ids is None:
                    return None
                keys = self.keyer(base).keys_for(token_ids, lora, salt)
        except Exception as exc:  # any tokenizer or keying failure: load-only routing
            self._tokenize_failures.labels(model).inc()
            log.debug("tokenization failed for %s: %r", model, exc)
            return None
        # The store writes this worker's deferred speculations first, then the siblings'.
        if self.peers is not None:
            await self.peers.settle(keys)  # the siblings' speculations and events, first
        with span("kvgate.index_lookup"):
            match = await self.store.match(keys, self.block_size(base))
        return IndexAnswer(len(token_ids), keys, match, time.perf_counter() - started)

    def speculate(self, pod: str, keys: Sequence[int]) -> None:
        """The routing core's speculation. Sibling workers and a shared store get it at
        once (another worker's or replica's next request may share the prefix). This
        process's own memory index is written at its next use (a lookup, an event
        batch: ``kvindex.deferred``) or once this request's response has started
        (``flush_speculations``), whichever comes first: off the request's way to the
        pod, where it cost a new 8 KB prompt ~0.1 ms. Its TTL counts from that write."""
        if self.peers is not None:
            self.peers.speculated(pod, keys)
        if self._deferring is not None:
            self._deferring.defer(pod, keys, self._s.index.speculative_ttl_s)
        else:
            self._write_speculation(pod, keys)

    def flush_speculations(self) -> None:
        """Write the deferred speculations, in the order they were dispatched."""
        if self._deferring is not None:
            self._deferring.flush()

    def _write_speculation(self, pod: str, keys: Sequence[int]) -> None:
        """Recorded in the local view now; a shared store's write follows in the background."""
        pending = self.store.speculate_nowait(pod, keys, self._s.index.speculative_ttl_s)
        if pending is not None:
            self._background(pending)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        if len(self._pending) >= MAX_PENDING_SPECULATIONS:
            coro.close()
            self.speculations_dropped += 1
            return
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # -- pods and events --

    async def pod_admitted(self, pod: Pod) -> None:
        """Start following a pod's KV events once we know which model it serves; follow
        them anew where its engine was replaced under a running subscriber."""
        cfg = pod.config
        model = pod.engine_model
        ingestor = self._ingestor_of(pod.name)
        if ingestor is not None and self._engine_replaced(pod, ingestor, model):
            await self.refollow([pod])  # calls back here with no subscriber
            return
        if not cfg.kv_events or pod.name in self._subscribers:
            return
        if model is None:
            log.warning("pod %s publishes KV events but serves no known model", pod.name)
            return
        sub = KVEventSubscriber(
            pod.name,
            cfg.kv_events,
            cfg.kv_replay,
            self.keyer(model),
            self.store,
            self.event_metrics,
            dp_size=cfg.dp_ranks,
            map_capacity=self._s.index.engine_map_capacity,
            warm_start=self._s.index.warm_start,
        )
        self._subscribers[pod.name] = sub
        self._followed_restarts[pod.name] = pod.restarts
        await sub.start()
        log.info("following KV events of %s at %s", pod.name, cfg.kv_events)

    def _engine_replaced(self, pod: Pod, ingestor: PodIngestor, model: str | None) -> bool:
        """Whether ``ingestor`` follows an engine the pod no longer runs, though the pod
        was never ejected: it restarted between two probes (``PodRegistry`` saw a later
        process start), so its cache is empty while the index holds the old process's
        entries until the new one publishes, which an idle pod may not do for hours; or
        it serves another model (restarted under a new served name), and its events were
        keyed under the old one. Either way: forget them, follow its events anew."""
        if model is not None and ingestor.keyer.model != model:
            return True
        followed = self._followed_restarts.get(pod.name)
        if followed is not None and pod.restarts > followed:
            log.info("pod %s restarted: its index entries are dropped and its KV events "
                     "followed anew", pod.name)  # fmt: skip
            return True
        return False

    async def pod_ejected(self, pod: Pod) -> None:
        """An ejected pod's cache is unknown (it may have restarted): forget it, and
        stop following its events, so that ``pod_admitted`` follows them anew when it is
        readmitted (with the pod's replay endpoint, its history is replayed from the
        start, as at a warm start).

        Why not keep the subscriber: most ejections are blips (probes that timed out
        under load, a few failed requests) of a pod that kept its cache, and a
        subscriber kept across the drop only sees the blocks stored after it: what the
        pod held before was gone from the index for good (routing predicted 0 cached
        tokens for its prefixes, and sent them elsewhere)."""
        sub = self._subscribers.pop(pod.name, None)
        if sub is not None:
            await sub.stop()
        await self.store.drop_pod(pod.name)

    async def pod_removed(self, name: str) -> None:
        sub = self._subscribers.pop(name, None)
        if sub is not None:
            await sub.stop()
        self._http_ingestors.pop(name, None)
        self._followed_restarts.pop(name, None)
        self.tokens.forget_pod(name)
        self.event_metrics.forget_pod(name)
        await self.store.drop_pod(name)

    def forget_models(self, gone: Iterable[str], served: Collection[str]) -> None:
        """No pod serves ``gone`` any more (``PodRegistry.on_models_gone``): their keyers
        and tokenize-failure series go, and those of any other model no pod serves (a
        request that resolved its model before the model left counts its failure after).
        Nothing here waits for requests in flight: failures are counted before dispatch."""
        for model in gone:
            self._keyers.pop(model)
        failures = self._tokenize_failures
        for model in {*gone, *label_values([failures], "model")} - set(served):
            forget_label_value([failures], "model", model)

    async def ingest_http(self, pod: Pod, body: bytes, content_type: str) -> int:
        """``POST /admin/kv-events``: batches in vLLM's schema as msgpack or JSON.

        Sibling workers get the body too: an HTTP post reaches one worker only. It is
        checked first (a bad body reaches no worker) and applied here only once the
        siblings have it: a body the workers' bus cannot carry (over half a ring, a
        ring held too long) raises ``EventsNotShared`` with nothing applied, so the
        poster is told and may retry, and the workers' indexes stay one."""
        batches = decode_http_events(body, content_type)
        if self.peers is not None and not self.peers.events_posted(pod.name, body, content_type):
            raise EventsNotShared(f"KV events for {pod.name} could not reach the sibling workers")
        return await self._apply_batches(pod, batches)

    async def apply_http_events(self, pod: Pod, body: bytes, content_type: str) -> int:
        """Apply one ``/admin/kv-events`` body to this worker's index."""
        return await self._apply_batches(pod, decode_http_events(body, content_type))

    async def _apply_batches(self, pod: Pod, batches: Sequence[EngineBatch]) -> int:
        # One engine-hash map per pod, whichever way its events arrive.
        ingestor = self._ingestor_of(pod.name)
        if ingestor is None:
            model = pod.engine_model
            if model is None:
                raise ValueError(f"pod {pod.name} serves no known model yet")
            ingestor = self._http_ingestors[pod.name] = PodIngestor(
                pod.name,
                self.keyer(model),
                self.store,
                self.event_metrics,
                self._s.index.engine_map_capacity,
            )
            self._followed_restarts[pod.name] = pod.restarts
        applied = 0
        for batch in batches:
            applied += await ingestor.apply_batch(batch, batch.dp_rank or 0)
            if not self._follows(pod.name, ingestor):
                # The pod left (or is followed anew) while the batch was written: what
                # landed after ``pod_removed`` dropped its entries would stay for ever.
                await self.store.drop_pod(pod.name)
                break
        return applied

    def _follows(self, name: str, ingestor: PodIngestor) -> bool:
        """Whether ``ingestor`` is still the one ``name``'s events go through."""
        return self._ingestor_of(name) is ingestor

    def _ingestor_of(self, name: str) -> PodIngestor | None:
        """What ``name``'s events go through: its subscriber's, else its posted events'."""
        sub = self._subscribers.get(name)
        return sub.ingestor if sub is not None else self._http_ingestors.get(name)

    def l0_blocks_now(self, pod: str) -> int | None:
        """``pod``'s L0 occupancy by its events (``IndexStore.l0_blocks_now``), or
        None where its events are not followed: a pod that publishes none (or has not
        posted any yet) may hold anything. A followed pod whose events stored nothing
        holds nothing this gateway knows of: a pod just started or reset is empty, and
        after a gateway restart every count starts at 0 alike (warm start replays
        what the pods still buffer)."""
        if pod not in self._subscribers and pod not in self._http_ingestors:
            return None
        return self.store.l0_blocks_now(pod)

    def followed_pods(self) -> list[str]:
        """Pods whose KV events this index follows over ZMQ."""
        return list(self._subscribers)

    def history_replayed(self, pod: str) -> bool | None:
        """Whether ``pod``'s KV-event history has been replayed since we started
        following it (``index.warm_start``); None: its events are not followed."""
        sub = self._subscribers.get(pod)
        return None if sub is None else sub.warmed.is_set()

    def subscriber_stats(self) -> dict[str, Any]:
        return {name: sub.stats for name, sub in self._subscribers.items()}

    def bounds(self) -> dict[str, Bound]:
        """How full every bounded structure of the index side is (``/admin/bounds``)."""
        store: Any = self.store
        out: dict[str, Bound] = dict(store.bounds()) if hasattr(store, "bounds") else {}
        ingestors = [s.ingestor for s in self._subscribers.values()]
        for ingestor in [*ingestors, *self._http_ingestors.values()]:
            out.update(ingestor.bounds())
        out.update(self.tokens.bounds())
        out.update(self._keyer_caches.bounds())
        out["keyers"] = Bound(len(self._keyers), MAX_KEYERS, "keyers", KEYER_BYTES)
        pending = Bound(len(self._pending), MAX_PENDING_SPECULATIONS, "writes", 2_000)
        out["speculations_pending"] = pending
        return out

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        for sub in self._subscribers.values():
            await sub.stop()
        self._subscribers.clear()
        await self.store.close()


def lora_of(model: str, pods: list[Pod]) -> tuple[str, str | None]:
    """``(base model, adapter)`` of a requested model: ``(model, None)`` unless a pod
    lists it as an adapter (a card with a ``parent``) of a base model the same pod
    serves, and no pod serves it as a base model. So one pod's card cannot make a base
    model an adapter for the whole fleet (its keys would then match no pod's events)."""
    adapter_of: str | None = None
    for pod in pods:
        if model not in pod.model_cards:
            continue
        parent = pod.parent_of(model)
        if parent is None:
            return model, None  # served as a base model
        if adapter_of is None and parent in pod.models and pod.parent_of(parent) is None:
            adapter_of = parent
    return (adapter_of, model) if adapter_of is not None else (model, None)


class IndexPeers(Protocol):
    """Sibling worker processes of this gateway (``gateway.siblings``)."""

    async def settle(self, keys: Sequence[int]) -> None:
        """Before a lookup of ``keys``: apply what the siblings published that it needs:
        their speculations of chains that start as ``keys`` does, and the KV event
        bodies posted to them (awaited: a lookup right after a
        sibling accepted events for a pod must see them)."""

    def speculated(self, pod: str, keys: Sequence[int]) -> None:
        """This worker recorded a speculation the siblings' indexes need too."""

    def events_posted(self, pod: str, body: bytes, content_type: str) -> bool:
        """An HTTP event body the siblings must apply too, published to them before this
        worker applies it; False if it could not be."""


class EventsNotShared(RuntimeError):
    """A posted event body the sibling workers could not be given (nothing applied)."""
