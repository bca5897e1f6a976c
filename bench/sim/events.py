"""KV events on vLLM 0.32's exact wire format: ZMQ PUB live stream + ROUTER replay.

Mirrors ``vllm/distributed/kv_events.py``: the structs below are declared with
the same msgspec options, field names and order, so ``msgspec.msgpack`` encodes
them to the same bytes vLLM sends. Frames are ``[topic, seq (8-byte BE, from 0),
payload]``; payload is the array ``[ts, [events...], data_parallel_rank]``; each
event a map tagged ``"type"`` (vLLM >= 0.24). ``old_shape`` emits vLLM <= 0.23's
positional arrays (tag first) instead, and ``bytes_hashes`` the raw 32-byte
digests instead of uint64s, so decoders can be tested against every variant.

Replay (vLLM >= 0.26): a DEALER sends ``[b"", start_seq 8B BE]``; the ROUTER
answers ``[b"", topic, seq, payload]`` per buffered batch with seq >= start, then
``[b"", b"", 0xFF*8, b""]``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from bench.sim.config import KVEventsSettings
from bench.sim.hashing import BlockHash, external_hash

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
ExternalHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged (vLLM >= 0.24) events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class _OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the positional (vLLM <= 0.23) events."""


class OldBlockStored(_OldEvent, tag="BlockStored"):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(_OldEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalHash]
    medium: str | None


class OldAllBlocksCleared(_OldEvent, tag="AllBlocksCleared"):
    pass


AnyEvent = BlockStored | BlockRemoved | AllBlocksCleared


def to_old_shape(event: AnyEvent) -> _OldEvent:
    """The same event as vLLM <= 0.23 sent it (no extra keys, groups, locality)."""
    if isinstance(event, BlockStored):
        return OldBlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        )
    if isinstance(event, BlockRemoved):
        return OldBlockRemoved(event.block_hashes, event.medium)
    return OldAllBlocksCleared()


class EventFactory:
    """Builds events with this pod's hash form; vLLM 0.32 field values for L0."""

    def __init__(self, block_size: int, bytes_hashes: bool = False) -> None:
        self.block_size = block_size
        self.bytes_hashes = bytes_hashes

    def ext(self, block_hash: BlockHash) -> ExternalHash:
        return block_hash if self.bytes_hashes else external_hash(block_hash)

    def stored(
        self,
        hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        token_ids: list[int],
        extra_keys: list[tuple[Any, ...] | None],
        medium: str = "GPU",
        lora: tuple[int, str] | None = None,
    ) -> BlockStored:
        return BlockStored(
            block_hashes=[self.ext(h) for h in hashes],
            parent_block_hash=None if parent is None else self.ext(parent),
            token_ids=token_ids,
            block_size=self.block_size,
            lora_id=None if lora is None else lora[0],
            medium=medium,
            lora_name=None if lora is None else lora[1],
            extra_keys=extra_keys or None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def removed(self, block_hash: BlockHash, medium: str = "GPU") -> BlockRemoved:
        # vLLM sends one BlockRemoved per evicted hash.
        return BlockRemoved(block_hashes=[self.ext(block_hash)], medium=medium, group_idx=0)

    def offload_stored(
        self, block_hash: BlockHash, medium: str, locality: str | None = None
    ) -> BlockStored:
        """A block stored in an offload tier, as vLLM's OffloadingConnector reports it.

        ``take_events`` there: one hash, no parent, empty ``token_ids``, ``block_size``
        0, the tier's medium, in the GPU events' hash space; ``locality`` tells a
        shared (``REMOTE``) storage tier from a pod-local one.
        """
        return BlockStored(
            block_hashes=[self.ext(block_hash)],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=medium,
            lora_name=None,
            locality=locality,
        )

    def offload_removed(
        self, block_hash: BlockHash, medium: str, locality: str | None = None
    ) -> BlockRemoved:
        return BlockRemoved(block_hashes=[self.ext(block_hash)], medium=medium, locality=locality)


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule: data-parallel rank r publishes on port + r (port 0 left alone)."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"


def _is_bind_endpoint(endpoint: str) -> bool:
    """vLLM binds wildcard and ipc/inproc endpoints and connects to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB + ROUTER on one background thread, like vLLM's ``ZmqEventPublisher``.

    ``publish`` only enqueues, so the request path never blocks on ZMQ.
    """

    def __init__(self, settings: KVEventsSettings, data_parallel_rank: int = 0) -> None:
        self.settings = settings
        self.rank = data_parallel_rank
        self.endpoint = offset_endpoint_port(settings.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(settings.replay_endpoint, data_parallel_rank)
        self._topic = settings.topic.encode("utf-8")
        self._queue: queue.Queue[list[AnyEvent] | None] = queue.Queue(maxsize=100_000)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(settings.hwm)
        assert self.endpoint is not None
        if _is_bind_endpoint(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._replay: zmq.Socket | None = None
        if self.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(self.replay_endpoint)
        self.published = 0  # batches sent, for /sim/state
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[AnyEvent]) -> None:
        """Queue one batch (one engine step's events); dropped if the queue is full."""
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            log.warning("kv event queue full; batch dropped")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _encode(self, events: list[AnyEvent]) -> bytes:
        body: list[Any] = list(events)
        if self.settings.old_shape:
            body = [to_old_shape(e) for e in events]
        return msgspec.msgpack.encode(EventBatch(time.time(), body, self.rank))

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._service_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = self._encode(events)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.published += 1
            seq += 1

    def _service_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid replay request with %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
