"""KVEventSubscriber against real ZMQ sockets speaking vLLM's PUB + ROUTER protocol.

``Publisher`` below is a small re-implementation of vLLM's ZmqEventPublisher (same
frames, same replay replies, same end marker) with two knobs a real engine lacks:
``live=False`` keeps a batch out of the live stream (a lost message) and ``restart()``
closes and rebinds the sockets with seq starting from 0 again (a new engine process).
"""

import asyncio
import contextlib
import functools
import time
from collections import deque

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from zmq.utils.monitor import parse_monitor_message

from bench.polling import wait_for_async
from kvindex.events.subscriber import MAX_FRAME_BYTES, KVEventSubscriber
from kvindex.keyer import BlockKeyer
from kvindex.memory_store import MemoryStore
from kvindex.metrics import EventMetrics
from kvindex.store import Cleared, Stored
from kvindex.types import Tier
from tests.recording_store import RecordingStore

BS = 4
KEYER = BlockKeyer("tiny", BS)
TOKENS = list(range(500, 540))  # 10 blocks
END = (2**64 - 1).to_bytes(8, "big")
FORGED_SEQ = 2**64 - 2  # the highest seq that is not the replay's end marker


def stored(i, medium="GPU"):
    """BlockStored of block i of TOKENS, engine hash 1000 + i, chained to block i - 1."""
    return {
        "type": "BlockStored",
        "block_hashes": [1000 + i],
        "parent_block_hash": 1000 + i - 1 if i else None,
        "token_ids": TOKENS[i * BS : (i + 1) * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


class Publisher:
    def __init__(self, ctx, port=0, replay_port=0, old_replay_shape=False, topic=b"kv"):
        self.ctx, self.topic, self.old = ctx, topic, old_replay_shape
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.seq = 0
        self.answer_replays = True
        self.drop_in_next_replay: set[int] = set()  # seqs its ROUTER "drops" once
        self._bind(port, replay_port)

    def _bind(self, port, replay_port):
        self.pub = self.ctx.socket(zmq.PUB)
        self.router = self.ctx.socket(zmq.ROUTER)
        for sock in (self.pub, self.router):
            sock.setsockopt(zmq.LINGER, 0)
        if port:
            self.pub.bind(f"tcp://127.0.0.1:{port}")
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")  # a failure leaves no task
            self.port, self.replay_port = port, replay_port
        else:
            self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.task = asyncio.create_task(self._serve_replay())

    @property
    def endpoint(self):
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self):
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def publish(self, *events, live=True):
        payload = msgspec.msgpack.encode([time.time(), list(events), 0])
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def _serve_replay(self):
        # As vLLM's publisher thread does: every buffered batch sent at once, never
        # waiting for the client (a ROUTER drops what is past its high-water mark).
        router = zmq.Socket.shadow(self.router.underlying)
        while True:
            client, _, start = await self.router.recv_multipart()
            if not self.answer_replays:
                continue
            start_seq = int.from_bytes(start, "big")
            head = [client, b""] if self.old else [client, b"", self.topic]
            dropped, self.drop_in_next_replay = self.drop_in_next_replay, set()
            for seq, buf in list(self.buffer):
                if seq >= start_seq and seq not in dropped:
                    router.send_multipart([*head, seq.to_bytes(8, "big"), buf])
            router.send_multipart([*head[:2], b"", END, b""])

    async def close(self):
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.pub.close(0)
        self.router.close(0)

    async def restart(self):
        """A new engine process on the same ports: empty buffer, seq from 0."""
        await self.close()
        self.buffer.clear()
        self.seq = 0

        def rebound() -> bool:
            try:
                self._bind(self.port, self.replay_port)
                return True
            except zmq.ZMQError:
                self.pub.close(0)
                self.router.close(0)
                return False

        # The old sockets release their ports asynchronously.
        await wait_for_async(rebound, timeout=2.0, what="the publisher's ports to rebind")


wait_until = functools.partial(wait_for_async, timeout=5.0, poll=0.01)


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def connected_subscriber(pub, store, registry=None, **kw):
    metrics = EventMetrics(registry or CollectorRegistry())
    sub = KVEventSubscriber(
        "pod-a",
        pub.endpoint,
        pub.replay_endpoint,
        KEYER,
        store,
        metrics,
        topic="kv",
        replay_timeout_s=0.5,
        context=pub.ctx,
        **kw,
    )
    await sub.start()
    await wait_until(lambda: all(r["connected"] for r in sub.stats.values()))
    await asyncio.sleep(0.2)  # let the subscription reach the PUB socket
    return sub


def stored_keys(store):
    return [k for op in store.ops() if isinstance(op, Stored) for k in op.keys]


async def test_live_batches_are_applied_in_order(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    sub = await connected_subscriber(pub, store, bootstrap_replay=False)
    for i in range(3):
        await pub.publish(stored(i))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 2)
    assert store.ops() == [Stored(Tier.L0, [k]) for k in KEYER.keys(TOKENS[:12])]
    await sub.stop()
    await pub.close()


@pytest.mark.parametrize("old_replay_shape", [False, True], ids=["vllm>=0.26", "vllm<0.26"])
async def test_a_gap_is_filled_by_replay_and_duplicates_are_dropped(ctx, old_replay_shape):
    pub, store, registry = (
        Publisher(ctx, old_replay_shape=old_replay_shape),
        RecordingStore(),
        CollectorRegistry(),
    )
    sub = await connected_subscriber(pub, store, registry)
    await pub.publish(stored(0))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 0)
    await pub.publish(stored(1), live=False)  # lost on the wire
    await pub.publish(stored(2), live=False)
    await pub.publish(stored(3))  # gap detected here; the replay returns 1, 2, 3
    await pub.publish(stored(4))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 4)
    assert stored_keys(store) == KEYER.keys(TOKENS[:20])
    stats = sub.stats[0]
    assert (stats["gaps"], stats["replays"], stats["lost_batches"]) == (1, 1, 0)
    assert registry.get_sample_value("kvgate_kv_event_seq_gaps_total", {"pod": "pod-a"}) == 1
    assert registry.get_sample_value("kvgate_kv_event_replays_total", {"pod": "pod-a"}) == 1
    await sub.stop()
    await pub.close()


async def test_a_replay_that_never_answers_is_bounded_and_the_loss_counted(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    pub.answer_replays = False
    sub = await connected_subscriber(pub, store, bootstrap_replay=False)
    await pub.publish(stored(0))
    await pub.publish(stored(1), live=False)
    started = time.monotonic()
    await pub.publish(stored(2))  # its parent (block 1) was lost: its hash is unknown
    await wait_until(lambda: sub.stats[0]["last_seq"] == 2)
    assert time.monotonic() - started < 2.0
    assert stored_keys(store) == KEYER.keys(TOKENS[:4])
    assert (sub.stats[0]["replay_timeouts"], sub.stats[0]["lost_batches"]) == (1, 1)
    await sub.stop()
    await pub.close()


async def test_joining_mid_stream_replays_the_pods_history_from_zero(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    for i in range(3):
        await pub.publish(stored(i))  # nobody listening yet
    sub = await connected_subscriber(pub, store)
    await pub.publish(stored(3))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 3)
    assert stored_keys(store) == KEYER.keys(TOKENS[:16])
    assert sub.stats[0]["gaps"] == 0
    await sub.stop()
    await pub.close()


async def test_engine_restart_clears_the_pod_and_relearns_from_the_new_process(ctx):
    pub, store, registry = Publisher(ctx), RecordingStore(), CollectorRegistry()
    sub = await connected_subscriber(pub, store, registry)
    for i in range(3):
        await pub.publish(stored(i))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 2)
    await pub.restart()
    await wait_until(lambda: sub.stats[0]["connected"])
    await asyncio.sleep(0.2)
    await pub.publish(stored(0))  # seq 0 again
    await wait_until(lambda: sub.stats[0]["restarts"] == 1 and sub.stats[0]["last_seq"] == 0)
    keys = KEYER.keys(TOKENS[:12])
    assert store.ops() == [
        *(Stored(Tier.L0, [k]) for k in keys),
        Cleared((Tier.L0, Tier.L1)),
        Stored(Tier.L0, [keys[0]]),
    ]
    assert registry.get_sample_value("kvgate_kv_engine_restarts_total", {"pod": "pod-a"}) == 1
    assert sub.stats[0]["forced_reconnects"] == 0  # ZMQ retried this one itself
    await sub.stop()
    await pub.close()


async def test_seq_going_backwards_without_a_reconnect_is_a_restart(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    sub = await connected_subscriber(pub, store)
    for i in range(3):
        await pub.publish(stored(i))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 2)
    pub.seq = 1  # same sockets, counter reset
    pub.buffer.clear()
    await pub.publish(stored(0))
    await wait_until(lambda: sub.stats[0]["restarts"] == 1)
    assert isinstance(store.ops()[3], Cleared)
    await sub.stop()
    await pub.close()


async def test_each_dp_rank_listens_on_port_plus_rank(ctx):
    for _ in range(20):  # find two consecutive free port pairs
        pub0 = Publisher(ctx)
        try:
            pub1 = Publisher(ctx, pub0.port + 1, pub0.replay_port + 1)
            break
        except zmq.ZMQError:
            await pub0.close()
    else:
        pytest.skip("no consecutive free ports")
    store = MemoryStore(10_000)
    sub = await connected_subscriber(pub0, store, dp_size=2)
    assert sub.stats[1]["endpoint"] == f"tcp://127.0.0.1:{pub0.port + 1}"
    await pub0.publish(stored(0))
    await pub1.publish(stored(0), stored(1))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 0 and sub.stats[1]["last_seq"] == 0)
    match = await store.match(KEYER.keys(TOKENS[:8]), BS)
    assert match.for_pod("pod-a").l0 == 2
    await sub.stop()
    await pub0.close()
    await pub1.close()


async def test_malformed_frames_are_counted_and_the_stream_goes_on(ctx):
    pub, store, registry = Publisher(ctx), RecordingStore(), CollectorRegistry()
    sub = await connected_subscriber(pub, store, registry, bootstrap_replay=False)
    await pub.pub.send_multipart([b"kv", b"\x00", b"junk"])  # bad seq frame
    await pub.publish(stored(0))
    pub.buffer.append((1, b"\xc1"))
    await pub.pub.send_multipart([b"kv", (1).to_bytes(8, "big"), b"\xc1"])  # bad payload
    pub.seq = 2
    await pub.publish(stored(1))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 2)
    assert stored_keys(store) == KEYER.keys(TOKENS[:8])
    assert registry.get_sample_value("kvgate_kv_event_decode_errors_total", {"pod": "pod-a"}) == 2
    await sub.stop()
    await pub.close()


async def test_a_forged_seq_past_the_gap_in_a_replay_does_not_stall_the_live_stream(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    sub = await connected_subscriber(pub, store, bootstrap_replay=False)
    await pub.publish(stored(0))
    await pub.publish(stored(1), live=False)
    pub.buffer.append((FORGED_SEQ, msgspec.msgpack.encode([time.time(), [stored(9)], 0])))
    await pub.publish(stored(2))  # the gap: the replay answers 1, the forged seq, 2
    await wait_until(lambda: sub.stats[0]["last_seq"] == 2)
    await pub.publish(stored(3))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 3)
    assert stored_keys(store) == KEYER.keys(TOKENS[:16])
    assert (sub.stats[0]["duplicates"], sub.stats[0]["restarts"]) == (0, 0)
    await sub.stop()
    await pub.close()


def padded(event, size):
    """A batch of ``event`` and an unknown field that makes the payload ``size`` bytes."""
    body = msgspec.msgpack.encode([time.time(), [{**event, "pad": b""}], 0])
    header_growth = 3  # msgpack: b"" has a 2-byte bin header, megabytes a 5-byte one
    pad = b"\0" * (size - len(body) - header_growth)
    return msgspec.msgpack.encode([time.time(), [{**event, "pad": pad}], 0])


async def next_monitor_event(monitor):
    frames = await asyncio.wait_for(monitor.recv_multipart(), 5.0)
    return parse_monitor_message(frames)["event"]


async def test_a_live_frame_over_the_size_bound_is_refused_and_the_next_one_applied(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    sub = await connected_subscriber(pub, store, bootstrap_replay=False)
    await pub.publish(stored(0))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 0)
    monitor = pub.pub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
    oversized = padded(stored(9), MAX_FRAME_BYTES + 1)
    assert len(oversized) == MAX_FRAME_BYTES + 1
    await pub.pub.send_multipart([b"kv", (1).to_bytes(8, "big"), oversized])  # not buffered
    # ZMQ drops the connection rather than take the frame; the subscriber reconnects.
    assert await next_monitor_event(monitor) == zmq.EVENT_DISCONNECTED
    assert await next_monitor_event(monitor) == zmq.EVENT_ACCEPTED
    await asyncio.sleep(0.2)  # let the subscription reach the PUB socket again
    await pub.publish(stored(1))  # seq 1, the seq the oversized frame claimed
    await wait_until(lambda: sub.stats[0]["last_seq"] == 1)
    assert stored_keys(store) == KEYER.keys(TOKENS[:8])
    assert (sub.stats[0]["forced_reconnects"], sub.stats[0]["restarts"]) == (1, 0)
    pub.pub.disable_monitor()
    monitor.close(0)
    await sub.stop()
    await pub.close()


async def test_a_replayed_frame_over_the_size_bound_is_not_applied(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    sub = await connected_subscriber(pub, store, bootstrap_replay=False)
    await pub.publish(stored(0))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 0)
    pub.buffer.append((1, padded(stored(1), MAX_FRAME_BYTES + 1)))
    pub.seq = 2
    await pub.publish(stored(2))  # the gap: the replay's first answer is oversized
    await wait_until(lambda: sub.stats[0]["last_seq"] == 2)
    # Block 2's parent never arrived, so only block 0 is known.
    assert stored_keys(store) == KEYER.keys(TOKENS[:4])
    assert (sub.stats[0]["lost_batches"], sub.stats[0]["replay_timeouts"]) == (1, 1)
    await sub.stop()
    await pub.close()


# -- warm start: a gateway that joins or restarts learns an idle pod's cache at once ------


async def test_warm_start_replays_an_idle_pods_history_before_any_live_frame(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    for i in range(3):
        await pub.publish(stored(i))  # before the gateway started; the pod is idle since
    sub = await connected_subscriber(pub, store, warm_start=True)
    await asyncio.wait_for(sub.warmed.wait(), 2.0)
    assert stored_keys(store) == KEYER.keys(TOKENS[:12])
    assert (sub.stats[0]["last_seq"], sub.stats[0]["replays"]) == (2, 1)
    await sub.stop()
    await pub.close()


async def test_a_long_history_sent_at_once_is_replayed_whole(ctx):
    # vLLM keeps 10,000 batches and sends them back to back; its ROUTER drops what is
    # past its high-water mark (1,000 messages). A client that reads no faster than its
    # own default 1,000 lost most of a long history and then, on the first live frame,
    # replayed the gap again while requests were being served (each replay also holds
    # the pod's publisher thread, and the GIL, for the whole buffer).
    pub, store = Publisher(ctx), RecordingStore()
    history = 10_000
    # ~1 KB a batch, as a real pod's (a block stored, and blocks it never held evicted):
    # 10 MB in all, more than the loopback's socket buffers take at once.
    evicted = {"type": "BlockRemoved", "block_hashes": list(range(2**60, 2**60 + 100)),
               "medium": "GPU"}  # fmt: skip
    for i in range(history):
        await pub.publish(stored(i % 10), evicted, live=False)
    sub = await connected_subscriber(pub, store, warm_start=True)
    try:
        await asyncio.wait_for(sub.warmed.wait(), 5.0)
        stats = sub.stats[0]
        assert stats["last_seq"] == history - 1
        # The end marker came, in every replay asked. On a busy machine this process's
        # ZMQ I/O thread can still fall behind the publisher and leave a hole, which
        # one more replay from the hole fills (below); the default queue of 1,000 lost
        # the end marker twice and needed two or three replays, every time.
        assert stats["replay_timeouts"] == 0
        replays = stats["replays"]
        assert replays <= 2
        await pub.publish(stored(0))  # the next live frame: no gap, no further replay
        await wait_until(lambda: sub.stats[0]["last_seq"] == history)
        assert (sub.stats[0]["replays"], sub.stats[0]["lost_batches"]) == (replays, 0)
    finally:
        await sub.stop()
        await pub.close()


async def test_a_hole_in_the_start_up_replay_is_fetched_again_before_ready(ctx):
    # What the pod's ROUTER drops when this process cannot drain it in time (two
    # pods' replays at once on a busy 2-core machine lost 30-80 of 6,000 batches).
    pub, store = Publisher(ctx), RecordingStore()
    for i in range(10):
        await pub.publish(stored(i), live=False)
    pub.drop_in_next_replay = {4, 5}
    sub = await connected_subscriber(pub, store, warm_start=True)
    try:
        await asyncio.wait_for(sub.warmed.wait(), 5.0)
        stats = sub.stats[0]
        assert (stats["last_seq"], stats["replays"]) == (9, 2)  # one more, from seq 4
        assert stored_keys(store) == KEYER.keys(TOKENS)  # every block, in order
        await pub.publish(stored(0))  # the next live frame: no gap
        await wait_until(lambda: sub.stats[0]["last_seq"] == 10)
        assert (sub.stats[0]["replays"], sub.stats[0]["gaps"]) == (2, 0)
    finally:
        await sub.stop()
        await pub.close()


@pytest.mark.parametrize("seen_live", [0, 3], ids=["first-live-frame", "gap"])
async def test_a_hole_in_a_replay_under_traffic_is_fetched_again(ctx, seen_live):
    # A replay from 0 after a reconnect that looks like a restart is as long as a
    # start-up one, and the pod drops from it alike.
    pub, store = Publisher(ctx), RecordingStore()
    sub = await connected_subscriber(pub, store) if seen_live else None
    for i in range(10):
        await pub.publish(stored(i), live=i < seen_live)  # the rest lost to the socket
    if sub is None:
        sub = await connected_subscriber(pub, store)
    else:
        await wait_until(lambda: sub.stats[0]["last_seq"] == seen_live - 1)
    pub.drop_in_next_replay = {5, 6}
    try:
        await pub.publish(stored(0))  # live: the history, or the gap, is replayed
        await wait_until(lambda: sub.stats[0]["last_seq"] == 10)
        stats = sub.stats[0]
        assert (stats["replays"], stats["lost_batches"]) == (2, 0)  # one more, from 5
        assert stored_keys(store) == KEYER.keys(TOKENS) + KEYER.keys(TOKENS[:4])
    finally:
        await sub.stop()
        await pub.close()


class SlowStore(RecordingStore):
    """An index whose every apply takes 1 ms of the loop's thread without suspending
    (as the memory index's never suspends), recording how often a request got its
    turn on the loop in between."""

    def __init__(self):
        super().__init__()
        self.turns = 0  # times the other task ran
        self.turns_at_apply: list[int] = []

    async def apply(self, pod, ops):
        self.turns_at_apply.append(self.turns)
        time.sleep(0.001)
        await super().apply(pod, ops)


async def _take_turns(store):
    while True:
        await asyncio.sleep(0)
        store.turns += 1


@pytest.mark.parametrize("warm_start", [True, False], ids=["warm-start", "first-live-frame"])
async def test_a_replayed_history_is_applied_in_slices_that_let_requests_in(ctx, warm_start):
    # A whole history applied in one go held the loop for 4.2 s (10,000 batches), on
    # start-up and whenever a pod's history is replayed under traffic.
    pub, store = Publisher(ctx), SlowStore()
    for i in range(60):
        await pub.publish(stored(i % 10), live=False)
    others = asyncio.create_task(_take_turns(store))
    sub = await connected_subscriber(pub, store, warm_start=warm_start)
    try:
        if not warm_start:
            await pub.publish(stored(0))  # the first live frame asks for the history
        await wait_until(lambda: sub.stats[0]["last_seq"] == 60 - warm_start)
        applied = store.turns_at_apply[-(60 - warm_start) :]  # the replayed batches'
        # 60 ms of applying, given up every 5 ms: the other task ran during it.
        assert applied[-1] - applied[0] >= 5
    finally:
        others.cancel()
        await sub.stop()
        await pub.close()


async def test_live_frames_the_warm_replay_delivered_are_dropped_and_later_ones_applied(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    for i in range(2):
        await pub.publish(stored(i))
    sub = await connected_subscriber(pub, store, warm_start=True)
    await asyncio.wait_for(sub.warmed.wait(), 2.0)
    # A live frame the replay already covered (a slow subscription), then the next one.
    await pub.pub.send_multipart([b"kv", (1).to_bytes(8, "big"), pub.buffer[1][1]])
    await pub.publish(stored(2))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 2)
    assert stored_keys(store) == KEYER.keys(TOKENS[:12])
    assert (sub.stats[0]["duplicates"], sub.stats[0]["restarts"]) == (1, 0)
    await sub.stop()
    await pub.close()


async def test_warm_start_of_a_pod_whose_replay_never_answers_ends_within_its_timeout(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    pub.answer_replays = False
    await pub.publish(stored(0))
    started = time.monotonic()
    sub = await connected_subscriber(pub, store, warm_start=True)  # replay_timeout_s=0.5
    await asyncio.wait_for(sub.warmed.wait(), 2.0)
    assert time.monotonic() - started < 1.5
    assert (sub.stats[0]["replay_timeouts"], store.ops()) == (1, [])
    await sub.stop()
    await pub.close()


async def test_without_a_replay_endpoint_a_subscriber_is_warm_at_once(ctx):
    sub = KVEventSubscriber("pod-a", "tcp://127.0.0.1:1", None, KEYER, RecordingStore(),
                            warm_start=True, context=ctx)  # fmt: skip
    assert sub.warmed.is_set()


async def test_a_forged_seq_in_a_warm_replay_does_not_stall_the_live_stream(ctx):
    pub, store = Publisher(ctx), RecordingStore()
    for i in range(2):
        await pub.publish(stored(i))
    pub.buffer.append((FORGED_SEQ, msgspec.msgpack.encode([time.time(), [stored(9)], 0])))
    sub = await connected_subscriber(pub, store, warm_start=True)
    await asyncio.wait_for(sub.warmed.wait(), 2.0)
    assert sub.stats[0]["last_seq"] == 1
    await pub.publish(stored(2))
    await wait_until(lambda: sub.stats[0]["last_seq"] == 2)
    assert stored_keys(store) == KEYER.keys(TOKENS[:12])
    await sub.stop()
    await pub.close()
