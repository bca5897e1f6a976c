"""A worker's side of what the workers of one host tell each other (``--workers N``).

Every worker follows every pod's ZMQ events itself, so their indexes agree without
help. What reaches one worker only goes on its ring of the host bus
(``gateway.host_bus``) for the others:

* the speculative L0 entries of its dispatches (memory index only: with Redis they
  are in Redis already), so that a burst of one new prompt, spread over the workers
  by the kernel, waits for the pod that is prefilling it instead of prefilling it
  again elsewhere;
* KV-event bodies posted to its admin listener (``/admin/kv-events``): every worker
  applies them, in order, to its own index;
* ``POST /admin/reload``: every worker reloads its settings (``gateway.reload``);
* prefix-aware's choices (the prompt's chunk hashes and the pod they went to): each
  worker's strategy remembers its own, so without them a conversation whose turns the
  kernel spread over two workers went to two pods (the quick preset's RAG workload in
  front of simulated pods, ``--workers 2``: 80% cached against 93% with one worker).
  They are applied as they are drained, and before every routing.
* the token ids of a chat past its first turn, up to its last turn, as a local
  tokenizer newly keeps them, with 8 bytes naming that tokenizer: without them the
  conversation's next turn, on a connection the kernel gave another worker, is
  encoded there from the end of whatever that worker last saw of it (the overhead
  benchmark's multi-turn chats, ``--workers 2``: 1,170 characters encoded a request
  against 629 with one worker). A worker whose settings name another tokenizer for
  the model (a reload on its way) leaves them out.

Siblings' messages are read before every index lookup (``settle``, which also waits,
briefly, for event bodies already read to be applied: a lookup right after a sibling
answered a POST of events must see them) and every ``DRAIN_EVERY_S`` in the
background. A speculation carries its deadline on the
host's monotonic clock, so a late reader keeps it only for what is left.

A sibling's speculation is kept as it came, under its chain's first key, until a
lookup here starts with that key: block keys are chained, so a lookup shares a block
with a speculated prefix only if it shares the first one. Only then is it written
into the index. Most prompts are never looked up by a second worker within the
speculation's few seconds, and writing each of them into a large index (three
hash-table passes, a cache miss a key) was ~5% of each of two workers' CPU on new
prompts (py-spy, ``WORKERS=2 bench/profile_gateway.sh kv-aware varied``). What waits
is bounded in bytes (``MAX_PENDING_BYTES``, oldest first out); a head that is looked
up writes all of its speculations, those past their deadline aside.

With a Redis index only worker 0 writes KV events to Redis (``EventsWrittenElsewhere``
wraps the others' Redis store): the same events from every worker would be the same
writes N times over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from gateway.host_bus import BusEndpoint
from gateway.kv import KvIndex
from gateway.pods import PodRegistry
from kvindex.types import Bound
from routing.core import Routed, RoutingCore
from routing.strategies.prefix_aware import PrefixAware

log = logging.getLogger("kvgate.siblings")

SPECULATE = 1
HTTP_EVENTS = 2
RELOAD = 3  # POST /admin/reload reached one worker: every worker reloads its settings
PREFIX_ROUTED = 4  # prefix-aware sent a prompt's chunk hashes to a pod
PREFIX_TOKENS = 5  # a local tokenizer kept a new prompt prefix's token ids
DRAIN_EVERY_S = 0.01
REPORT_EVERY_S = 1.0  # the counts reach the metrics this often
# Longest a lookup waits for event bodies the siblings accepted to be applied here.
SETTLE_TIMEOUT_S = 0.5
MAX_QUEUED_BODIES = 256  # posted event bodies waiting to be applied here
# Siblings' speculations waiting for a lookup of their first key here: ~500k keys,
# a few seconds' worth at thousands of requests a second.
MAX_PENDING_BYTES = 4 << 20
_SPEC_HEAD = struct.Struct("<dH")  # deadline (monotonic s), pod name length
_EVENTS_HEAD = struct.Struct("<HH")  # pod name length, content type length
_ROUTED_HEAD = struct.Struct("<HH")  # model name length, pod name length
_TOKENS_HEAD = struct.Struct("<H8s16s")  # model name length, tokenizer, the prefix's key
# A prefix's ids take at most this share of a ring: a sibling that falls a whole ring
# behind skips what it missed, posted KV events included.
TOKENS_RING_SHARE = 16
_KEY = struct.Struct("=Q")  # a key as _pack_keys packs it


def _pack_keys(keys: Sequence[int]) -> bytes:
    """Keys (or chunk hashes) as a message's tail: native 8-byte words, one host."""
    return struct.pack(f"={len(keys)}Q", *keys)


def _unpack_keys(tail: bytes) -> list[int]:
    return memoryview(tail).cast("Q").tolist()


def encode_speculation(pod: str, keys: Sequence[int], deadline: float) -> bytes:
    name = pod.encode()
    return _SPEC_HEAD.pack(deadline, len(name)) + name + _pack_keys(keys)


def speculation_head(payload: bytes) -> int | None:
    """A speculation's first key (None: no keys), without decoding the rest."""
    _, n = _SPEC_HEAD.unpack_from(payload)
    at = _SPEC_HEAD.size + n
    if len(payload) < at + _KEY.size:
        return None
    return int(_KEY.unpack_from(payload, at)[0])


def decode_speculation(payload: bytes) -> tuple[str, list[int], float]:
    deadline, n = _SPEC_HEAD.unpack_from(payload)
    at = _SPEC_HEAD.size
    pod = payload[at : at + n].decode()
    keys = _unpack_keys(payload[at + n :])
    return pod, keys, deadline


def encode_prefix_routed(model: str, pod: str, hashes: Sequence[int]) -> bytes:
    m, p = model.encode(), pod.encode()
    return _ROUTED_HEAD.pack(len(m), len(p)) + m + p + _pack_keys(hashes)


def decode_prefix_routed(payload: bytes) -> tuple[str, str, list[int]]:
    m, p = _ROUTED_HEAD.unpack_from(payload)
    at = _ROUTED_HEAD.size
    model, pod = payload[at : at + m].decode(), payload[at + m : at + m + p].decode()
    return model, pod, _unpack_keys(payload[at + m + p :])


def encode_prefix_tokens(model: str, fingerprint: bytes, key: bytes, ids: array[int]) -> bytes:
    m = model.encode()
    return _TOKENS_HEAD.pack(len(m), fingerprint, key) + m + ids.tobytes()


def decode_prefix_tokens(payload: bytes) -> tuple[str, bytes, bytes, array[int]]:
    n, fingerprint, key = _TOKENS_HEAD.unpack_from(payload)
    at = _TOKENS_HEAD.size
    ids = array("I")
    ids.frombytes(payload[at + n :])
    return payload[at : at + n].decode(), fingerprint, key, ids


def encode_events(pod: str, body: bytes, content_type: str) -> bytes:
    name, ctype = pod.encode(), content_type.encode()
    return _EVENTS_HEAD.pack(len(name), len(ctype)) + name + ctype + body


def decode_events(payload: bytes) -> tuple[str, bytes, str]:
    n, c = _EVENTS_HEAD.unpack_from(payload)
    at = _EVENTS_HEAD.size
    pod, content_type = payload[at : at + n].decode(), payload[at + n : at + n + c].decode()
    return pod, payload[at + n + c :], content_type


class Siblings:
    """``KvIndex.peers`` of one worker: publish what the others need, apply theirs."""

    def __init__(
        self,
        endpoint: BusEndpoint,
        kv: KvIndex,
        registry: PodRegistry,
        *,
        share_speculation: bool,
        speculative_ttl_s: float,
        core: RoutingCore | None = None,
        metrics: SiblingMetrics | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.metrics = metrics
        self._kv = kv
        self._core = core  # whose prefix-aware strategies learn the siblings' choices
        self._registry = registry
        self._share_speculation = share_speculation
        self._ttl_s = speculative_ttl_s
        self._bodies: asyncio.Queue[tuple[str, bytes, str]] = asyncio.Queue(MAX_QUEUED_BODIES)
        self._tasks: list[asyncio.Task[None]] = []
        self.bodies_dropped = 0  # queue full, or the pod unknown here
        # first key -> siblings' speculations of chains starting with it, not yet applied
        self._pending: OrderedDict[int, deque[bytes]] = OrderedDict()
        self._pending_bytes = 0
        self.speculations_dropped = 0  # pushed out by MAX_PENDING_BYTES before a lookup
        self._applying = False  # a body is being applied now
        # Called when a sibling asks every worker to reload (``gateway.reload`` sets it).
        self.on_reload: Callable[[], None] | None = None
        endpoint.on(SPECULATE, self._on_speculation)
        endpoint.on(HTTP_EVENTS, self._on_events)
        endpoint.on(RELOAD, self._on_reload)
        endpoint.on(PREFIX_ROUTED, self._on_prefix_routed)
        endpoint.on(PREFIX_TOKENS, self._on_prefix_tokens)
        self._max_tokens_bytes = endpoint.bus.ring_bytes // TOKENS_RING_SHARE

    # -- IndexPeers ---------------------------------------------------------------------

    async def settle(self, keys: Sequence[int]) -> None:
        self.endpoint.drain()
        if keys and self._pending:
            held = self._pending.pop(keys[0], None)
            if held is not None:
                self._pending_bytes -= sum(map(len, held))
                for payload in held:
                    self._apply_speculation(payload)
        if self._bodies.qsize() or self._applying:
            # Event bodies a sibling accepted (its POST answered 200) are applied here
            # before this lookup; bounded, so a stuck store cannot hold requests.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SETTLE_TIMEOUT_S):
                    await self._bodies.join()

    def speculated(self, pod: str, keys: Sequence[int]) -> None:
        if self._share_speculation and keys:
            deadline = time.monotonic() + self._ttl_s
            self.endpoint.publish(SPECULATE, encode_speculation(pod, keys, deadline))

    def events_posted(self, pod: str, body: bytes, content_type: str) -> bool:
        """Publish a posted body to the siblings; False if the bus refused it."""
        if not self.endpoint.publish(HTTP_EVENTS, encode_events(pod, body, content_type)):
            log.warning("KV events posted for %s did not reach the sibling workers", pod)
            return False
        return True

    def drain(self) -> None:
        """Apply what the siblings published since the last drain (before a routing)."""
        self.endpoint.drain()

    def routed(self, routed: Routed) -> None:
        """The router's every decision: a prefix-aware one is told to the siblings."""
        hashes = routed.request.prefix_hashes
        if hashes and isinstance(routed.strategy, PrefixAware):
            payload = encode_prefix_routed(routed.request.model, routed.pod, hashes)
            self.endpoint.publish(PREFIX_ROUTED, payload)

    def prefix_tokenized(self, model: str, fingerprint: bytes, key: bytes, ids: array[int]) -> None:
        """A local tokenizer here kept a new prompt prefix (``PromptTokens.share_prefixes``):
        the siblings keep it too, so the conversation's next turn, on a connection the
        kernel gave one of them, is encoded from where this one ended."""
        if 4 * len(ids) <= self._max_tokens_bytes:
            payload = encode_prefix_tokens(model, fingerprint, key, ids)
            self.endpoint.publish(PREFIX_TOKENS, payload)

    def request_reload(self) -> None:
        """This worker was asked to reload its settings: the others must, too."""
        if not self.endpoint.publish(RELOAD, b""):
            log.warning("the reload request did not reach the sibling workers")

    # -- the siblings' messages ---------------------------------------------------------

    def _on_reload(self, sender: int, payload: bytes) -> None:
        if self.on_reload is not None:
            self.on_reload()

    def _on_prefix_routed(self, sender: int, payload: bytes) -> None:
        if self._core is None:
            return
        model, pod, hashes = decode_prefix_routed(payload)
        strategy = self._core.strategy_for(model)
        if isinstance(strategy, PrefixAware):  # a reload may have changed it since
            strategy.learn(hashes, pod)

    def _on_prefix_tokens(self, sender: int, payload: bytes) -> None:
        self._kv.tokens.learn_prefix(*decode_prefix_tokens(payload))

    def _on_speculation(self, sender: int, payload: bytes) -> None:
        """Keep it for a lookup of its first key (see the module docstring)."""
        first = speculation_head(payload)
        if first is None:
            return
        held = self._pending.get(first)
        if held is None:
            self._pending[first] = deque((payload,))
        else:
            # A busy head: what expired goes first (deadlines grow in arrival order).
            now = time.monotonic()
            while held and _SPEC_HEAD.unpack_from(held[0])[0] <= now:
                self._pending_bytes -= len(held.popleft())
            held.append(payload)
            self._pending.move_to_end(first)
        self._pending_bytes += len(payload)
        while self._pending_bytes > MAX_PENDING_BYTES and self._pending:
            _, dropped = self._pending.popitem(last=False)
            self._pending_bytes -= sum(map(len, dropped))
            self.speculations_dropped += len(dropped)

    def _apply_speculation(self, payload: bytes) -> None:
        pod, keys, deadline = decode_speculation(payload)
        left = deadline - time.monotonic()
        if left > 0:
            pending = self._kv.store.speculate_nowait(pod, keys, left)
            if pending is not None:  # a shared store: the sender wrote it there already
                pending.close()

    def _on_events(self, sender: int, payload: bytes) -> None:
        try:
            self._bodies.put_nowait(decode_events(payload))
        except asyncio.QueueFull:
            self.bodies_dropped += 1

    async def _apply_bodies(self) -> None:
        while True:
            name, body, content_type = await self._bodies.get()
            self._applying = True
            try:
                pod = self._registry.get(name)
                if pod is None:
                    self.bodies_dropped += 1
                    continue
                await self._kv.apply_http_events(pod, body, content_type)
            except Exception as exc:  # noqa: BLE001  (the sender validated it; log, go on)
                log.warning("sibling's KV events for %s not applied: %r", name, exc)
            finally:
                self._applying = False
                self._bodies.task_done()

    async def _drain_forever(self) -> None:
        reported = time.monotonic()
        while True:
            await asyncio.sleep(DRAIN_EVERY_S)
            try:
                self.endpoint.drain()
                if time.monotonic() - reported >= REPORT_EVERY_S:
                    reported = time.monotonic()
                    self.report()
            except Exception:  # a bug here must not stop the siblings' messages
                log.exception("draining the sibling workers' messages failed")

    def report(self) -> None:
        """Add the counts since the last report to the metrics (``SiblingMetrics``)."""
        if self.metrics is not None:
            self.metrics.report(self)

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._drain_forever(), name="kvgate-siblings"),
            asyncio.create_task(self._apply_bodies(), name="kvgate-sibling-events"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    def bounds(self) -> dict[str, Bound]:
        ring = self.endpoint.bus.ring_bytes
        return {
            "siblings.bodies_queued": Bound(
                self._bodies.qsize(), MAX_QUEUED_BODIES, "bodies", ring // 2
            ),  # fmt: skip
            "siblings.speculations_pending": Bound(
                self._pending_bytes, MAX_PENDING_BYTES, "bytes", 1
            ),  # fmt: skip
        }


class SiblingMetrics:
    """What the bus and the siblings counted, as Prometheus counters. The counts are
    plain attributes on the request's way (a multiprocess counter's update costs more),
    added to the counters once a second by the drain task (``Siblings.report``).

    A KV-event batch dropped here is one this worker's index lacks and its siblings'
    have: the workers' indexes differ until the pod's next events for those blocks (an
    operator alerts on ``kvgate_worker_dropped_total{what="events"}``)."""

    def __init__(self, prometheus: CollectorRegistry) -> None:
        self.messages = Counter(
            "kvgate_worker_messages",
            "Messages between a worker and its siblings, by outcome: published, received, "
            "refused (too large for the ring, or its lock not had in time: not sent), "
            "unreadable (received, but no handler could take it).",
            ["outcome"],
            registry=prometheus,
        )
        self.overruns = Counter(
            "kvgate_worker_ring_overruns",
            "Times a worker fell a whole sibling's ring behind and skipped what it had not read.",
            registry=prometheus,
        )
        self.dropped = Counter(
            "kvgate_worker_dropped",
            "What siblings sent that a worker did not apply: events (a KV-event batch posted "
            f"to a sibling, while {MAX_QUEUED_BODIES} others waited or for a pod unknown "
            "here) and speculations (pushed out before a lookup there used them).",
            ["what"],
            registry=prometheus,
        )
        # Every series from the start, at 0: an alert on one needs it to exist.
        for outcome in ("published", "received", "refused", "unreadable"):
            self.messages.labels(outcome)
        for what in ("events", "speculations"):
            self.dropped.labels(what)
        self._reported: dict[object, int] = {}  # a series: the count it was given so far

    def report(self, siblings: Siblings) -> None:
        """Add what was counted since the last report."""
        ep = siblings.endpoint
        messages, dropped = self.messages.labels, self.dropped.labels
        for series, count in (
            (messages("published"), ep.published), (messages("received"), ep.received),
            (messages("refused"), ep.refused), (messages("unreadable"), ep.bad),
            (self.overruns, ep.overruns),
            (dropped("events"), siblings.bodies_dropped),
            (dropped("speculations"), siblings.speculations_dropped),
        ):  # fmt: skip
            new = count - self._reported.get(series, 0)
            if new > 0:
                self._reported[series] = count
                series.inc(new)


class EventsWrittenElsewhere:
    """A ``RedisStore`` whose KV-event writes another worker of the host makes: here
    ``apply`` and ``drop_pod`` do nothing (the local view still takes them, in
    ``ResilientStore``); lookups, speculation and the rest go through."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def apply(self, pod: str, ops: Sequence[Any]) -> None:
        return None

    async def drop_pod(self, pod: str) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
