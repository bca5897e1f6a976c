"""Event ingestion throughput: real-format vLLM frames decoded and applied to a store.

``await measure_ingestion(store, n_blocks)`` builds msgpack payloads exactly as vLLM
0.32 publishes them (tagged maps, uint64 hashes, chained ``parent_block_hash``), then
times decode → translate → ``store.apply``. The mix per request: its blocks stored on
GPU in events of ``blocks_per_event`` blocks, every 4th block offloaded to CPU
(tokenless events), and every 8th removed from GPU. Issue 3 asks for >= 100k blocks/s
with the in-memory store.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvindex.events.ingest import PodIngestor
from kvindex.events.wire import END_SEQ, encode_seq
from kvindex.keyer import MASK64, BlockKeyer
from kvindex.store import IndexStore

_encoder = msgspec.msgpack.Encoder()


def _stored(
    hashes: list[int], parent: int | None, tokens: list[int], block_size: int, medium: str = "GPU"
) -> dict[str, object]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size if tokens else 0,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "group_idx": 0,
    }


def _request_events(
    rng: random.Random, blocks: int, block_size: int, blocks_per_event: int
) -> tuple[list[dict[str, object]], int]:
    """One request's events and the number of blocks they mention."""
    hashes = [rng.getrandbits(64) & MASK64 for _ in range(blocks)]
    tokens = [rng.randrange(150_000) for _ in range(blocks * block_size)]
    events: list[dict[str, object]] = []
    for start in range(0, blocks, blocks_per_event):
        end = min(blocks, start + blocks_per_event)
        parent = hashes[start - 1] if start else None
        events.append(
            _stored(
                hashes[start:end], parent, tokens[start * block_size : end * block_size], block_size
            )
        )
    offloaded = hashes[::4]
    events += [_stored([h], None, [], block_size, "CPU") for h in offloaded]
    removed = hashes[::8]
    events.append({"type": "BlockRemoved", "block_hashes": removed, "medium": "GPU"})
    return events, blocks + len(offloaded) + len(removed)


def make_payloads(
    n_blocks: int,
    block_size: int = 16,
    blocks_per_request: int = 64,
    blocks_per_event: int = 16,
    seed: int = 0,
) -> tuple[list[bytes], int]:
    """msgpack batches (one per request) mentioning about ``n_blocks`` blocks in all."""
    rng = random.Random(seed)
    payloads: list[bytes] = []
    total = 0
    while total < n_blocks:
        events, mentioned = _request_events(rng, blocks_per_request, block_size, blocks_per_event)
        payloads.append(_encoder.encode([time.time(), events, 0]))
        total += mentioned
    return payloads, total


async def measure_ingestion(
    store: IndexStore,
    n_blocks: int,
    block_size: int = 16,
    model: str = "bench-model",
    pod: str = "bench-pod",
) -> float:
    """Blocks per second through decode → translate → ``store.apply`` (frames pre-built)."""
    payloads, total = make_payloads(n_blocks, block_size)
    ingestor = PodIngestor(
        pod, BlockKeyer(model, block_size), store, map_capacity=max(1024, 2 * n_blocks)
    )
    started = time.perf_counter()
    for payload in payloads:
        await ingestor.apply_payload(payload)
    elapsed = time.perf_counter() - started
    return total / elapsed if elapsed > 0 else float("inf")


async def measure_live_batches(
    store: IndexStore, batches: int = 400, rate: float = 100.0, block_size: int = 16
) -> float:
    """The event loop's CPU per live batch, in µs: a real PUB socket on loopback (in
    a thread, as an engine publishes from its own process) sends ``batches`` one-block
    batches at ``rate`` a second to a ``KVEventSubscriber``; what the loop's thread
    spends receiving and applying them (``time.thread_time``) over the batches. At
    such rates every batch wakes the loop alone, as a pod's engine steps do, so this
    is the per-message cost that a throughput number (``measure_ingestion``) hides."""
    from prometheus_client import CollectorRegistry

    from bench.polling import wait_for_async
    from bench.ports import free_port
    from kvindex.events.subscriber import KVEventSubscriber
    from kvindex.metrics import EventMetrics

    port = free_port()
    started = threading.Event()

    def publish() -> None:
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{port}")
        started.wait(10)
        time.sleep(0.3)  # the subscription reaches the PUB socket
        for seq in range(batches):
            tokens = list(range(seq * block_size, (seq + 1) * block_size))
            parent = 10_000 + seq - 1 if seq else None
            event = _stored([10_000 + seq], parent, tokens, block_size)
            payload = _encoder.encode([time.time(), [event], 0])
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
            time.sleep(1 / rate)
        pub.close(linger=1000)
        ctx.term()

    sub = KVEventSubscriber("bench-pod", f"tcp://127.0.0.1:{port}", None,
                            BlockKeyer("bench-model", block_size), store,
                            EventMetrics(CollectorRegistry()), topic="kv",
                            bootstrap_replay=False)  # fmt: skip
    await sub.start()
    thread = threading.Thread(target=publish, daemon=True)
    thread.start()
    await asyncio.sleep(0.2)
    cpu_at_start = time.thread_time()
    started.set()

    def received() -> int:
        count = sub.stats[0]["batches"]
        assert isinstance(count, int)
        return count

    with contextlib.suppress(TimeoutError):  # what arrived is measured; none is an error
        await wait_for_async(lambda: received() >= batches, timeout=10 + 2 * batches / rate,
                             what="the live batches", poll=0.05)  # fmt: skip
    cpu = time.thread_time() - cpu_at_start
    await sub.stop()
    thread.join(5)
    if received() == 0:
        raise RuntimeError("no live batch arrived")
    return 1e6 * cpu / received()


REPLAY_BUFFER = 10_000  # vLLM's default ``buffer_steps``: the history a pod keeps
HISTORY_PROMPT_TOKENS = 1600  # each batch of ``pod_history``: the real-fleet prompts'


def pod_history(batches: int, block_size: int) -> list[bytes]:
    """A pod's KV-event history: ``batches`` batches of one 1,600-token prompt each,
    the real-fleet benchmark's prompt length (the mix of ``make_payloads``, its token
    ids from a 150k vocabulary, as a production model's: ~9 KiB a batch at block
    size 32)."""
    blocks = HISTORY_PROMPT_TOKENS // block_size
    payloads, _ = make_payloads(batches * blocks * 2, block_size, blocks_per_request=blocks)
    return payloads[:batches]


def _serve_history(port: int, batches: int, block_size: int, ready: Any) -> None:
    """A pod's replay endpoint in a process of its own, as vLLM's: a ROUTER at ZMQ's
    default high-water mark that answers a request with every kept batch from its
    start seq on, back to back (dropping what the client cannot take in time), then
    the end marker."""
    payloads = pod_history(batches, block_size)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    ready.set()
    while True:
        client, _, start = router.recv_multipart()
        if start == b"stop":
            break
        first = int.from_bytes(start, "big")
        for seq in range(first, len(payloads)):
            router.send_multipart([client, b"", b"kv", encode_seq(seq), payloads[seq]])
        router.send_multipart([client, b"", b"", encode_seq(END_SEQ), b""])
    router.close(linger=0)
    ctx.term()


@dataclass(frozen=True, slots=True)
class WarmStart:
    batches: int  # the pod's history
    payload_bytes: int  # its mean batch
    seconds: float  # subscriber started → warm
    applied: int  # batches applied (the history's, when whole)
    replays: int  # 1: the history arrived whole; more: holes asked for again
    timeouts: int  # replays that ended on the idle timeout (end marker lost)
    longest_stall_ms: float  # the event loop's longest wait for its turn meanwhile


async def measure_warm_start(
    store: IndexStore, batches: int = REPLAY_BUFFER, block_size: int = 32
) -> WarmStart:
    """A gateway's start-up replay of one pod's full history (``pod_history``): what
    ``/ready`` waits for. The pod is another process, its ROUTER vLLM's."""
    from prometheus_client import CollectorRegistry

    from bench.ports import free_port
    from kvindex.events.subscriber import KVEventSubscriber
    from kvindex.metrics import EventMetrics

    port = free_port()
    mp = multiprocessing.get_context("spawn")
    ready = mp.Event()
    pod = mp.Process(target=_serve_history, args=(port, batches, block_size, ready), daemon=True)
    pod.start()
    sample = pod_history(8, block_size)
    mean_bytes = sum(len(p) for p in sample) // len(sample)
    try:
        if not await asyncio.to_thread(ready.wait, 60):
            raise RuntimeError("the history's publisher did not start")
        endpoint = f"tcp://127.0.0.1:{port}"
        sub = KVEventSubscriber("bench-pod", f"tcp://127.0.0.1:{free_port()}", endpoint,
                                BlockKeyer("bench-model", block_size), store,
                                EventMetrics(CollectorRegistry()), topic="kv",
                                map_capacity=4 * (HISTORY_PROMPT_TOKENS // block_size) * batches,
                                warm_start=True)  # fmt: skip
        stalls = asyncio.create_task(_longest_stall(sub.warmed))
        started = time.perf_counter()
        await sub.start()
        await sub.warmed.wait()
        seconds = time.perf_counter() - started
        longest_stall = await stalls
        stats = sub.stats[0]
        await sub.stop()
    finally:
        ctx = zmq.Context()
        stop = ctx.socket(zmq.DEALER)
        stop.connect(f"tcp://127.0.0.1:{port}")
        stop.send_multipart([b"", b"stop"])
        pod.join(10)
        if pod.is_alive():
            pod.kill()
        stop.close(linger=0)
        ctx.term()
    return WarmStart(
        batches=batches,
        payload_bytes=mean_bytes,
        seconds=seconds,
        applied=int(stats["batches"]),  # type: ignore[call-overload]
        replays=int(stats["replays"]),  # type: ignore[call-overload]
        timeouts=int(stats["replay_timeouts"]),  # type: ignore[call-overload]
        longest_stall_ms=1000 * longest_stall,
    )


async def _longest_stall(done: asyncio.Event, tick_s: float = 0.001) -> float:
    """How much later than asked a ``tick_s`` timer ran at worst until ``done``: what
    a request or a probe arriving meanwhile would have waited for the loop."""
    worst = 0.0
    while not done.is_set():
        asked = time.perf_counter()
        await asyncio.sleep(tick_s)
        worst = max(worst, time.perf_counter() - asked - tick_s)
    return worst
