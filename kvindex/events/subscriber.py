"""Subscribe to one pod's vLLM KV-event stream(s) over ZMQ and keep the index current.

    sub = KVEventSubscriber(
        pod_id="pod-a",
        endpoint="tcp://10.0.0.7:5557",          # the pod's PUB (rank r: port + r)
        replay_endpoint="tcp://10.0.0.7:5558",   # its ROUTER, or None
        keyer=BlockKeyer(model, block_size),     # the model's router keys
        store=store, metrics=metrics, dp_size=1,
    )
    await sub.start(); ...; await sub.stop()

One SUB socket per data-parallel rank; ZMQ reconnects by itself (heartbeats catch a
peer that vanished without closing), except after a frame over ``MAX_FRAME_BYTES``
or a broken one, where it drops the connection for good and the subscriber
reconnects instead (``forced_reconnects``). Per rank the subscriber tracks ``seq``:

* ``seq == last + 1``: apply.
* a gap: ask the replay endpoint for everything from ``last + 1`` (bounded wait),
  apply in order up to the live frame that showed the gap; later batches come live.
* ``seq <= last`` (outside a replay's duplicates), or a jump right after the socket
  reconnected: the engine restarted. The pod's L0/L1 is dropped (``Cleared``), the
  rank's engine-hash map reset, and the new process's history replayed from 0.
* first frame ever with ``seq > 0``: replay from 0 to learn what the pod already holds
  (``bootstrap_replay``).
* ``warm_start``: replay from 0 as soon as the SUB socket is connected, without
  waiting for a live frame (an idle pod may publish nothing for minutes), so a
  gateway that joins or restarts knows what every pod holds before it routes;
  ``warmed`` is set once every rank's replay ended (answered, empty or timed out).
  Live frames the replay already delivered are dropped as duplicates.

A pod ejected by the gateway is dropped from the store by the gateway
(``store.drop_pod``); stopping its subscriber does not touch the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvindex.events.engine_map import DEFAULT_CAPACITY
from kvindex.events.ingest import PodIngestor
from kvindex.events.wire import END_SEQ, Frame, parse_live, parse_replay, replay_request
from kvindex.keyer import BlockKeyer
from kvindex.metrics import EventMetrics
from kvindex.store import IndexStore

log = logging.getLogger(__name__)


# Live messages handled back to back before the reader yields to the event loop.
_YIELD_EVERY = 32

# Largest message frame accepted from a pod (live or replayed); ZMQ drops the
# connection on a bigger one instead of buffering it, since up to RCVHWM live
# messages and ``replay_max_batches`` replayed ones may be held at once.
# vLLM's largest frame is the payload of one engine step: a step that stores 1M
# tokens (a whole 1M-token context prefilled at once, block size 16, 32-byte hashes,
# 5-byte token ids) encodes to 7.2 MiB, a default step (<= 16k tokens) to ~115 KiB;
# 16 MiB leaves twice the extreme case and over 100x the usual one.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# Replayed payloads held at once, before they are applied in order: the batch bound
# alone let a pod's replay pin ``replay_max_batches`` frames of up to MAX_FRAME_BYTES
# (312 GiB). vLLM keeps 10,000 batches of a few KiB (~115 KiB for a step that stores
# 16k tokens); a longer history is cut here and counted (``RankStats.replays_cut``).
MAX_REPLAY_BYTES = 256 * 1024 * 1024

# Replayed messages received back to back before the reader yields to the event loop
# (a message is ~20 µs to receive here; 256 of them hold the loop for ~5 ms).
_REPLAY_YIELD_EVERY = 256

# Longest the loop applies replayed batches before it yields to requests and probes.
_REPLAY_SLICE_S = 0.005

# Further replays a replay with a hole asks for, from the hole on (each one bounded as
# the first: ``replay_max_batches``, ``replay_max_bytes``).
_REFETCHES = 2

# ZMQ reports its retry (CONNECT_RETRIED) right after a DISCONNECTED it will retry;
# after a protocol error (a frame over MAXMSGSIZE, a broken frame) it never retries,
# and the SUB socket would stay deaf without a reconnect of our own.
_RETRY_GRACE_S = 0.5


def _has_message(socket: zmq.Socket[bytes]) -> bool:
    return bool(socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)


async def _wait_readable(readable: asyncio.Event, deadline: float | None) -> None:
    """Wait for ``readable``, or until the monotonic ``deadline`` when there is one."""
    if deadline is None:
        await readable.wait()
    else:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await readable.wait()
    readable.clear()


def _contiguous_run(replayed: dict[int, bytes]) -> list[int]:
    """The replayed seqs from the lowest one up to the first hole.

    vLLM replays a contiguous slice of its ring buffer, so a seq past a hole is not
    one of its batches."""
    run: list[int] = []
    for seq in sorted(replayed):
        if run and seq != run[-1] + 1:
            break
        run.append(seq)
    return run


def offset_port(endpoint: str, rank: int) -> str:
    """vLLM's rule: DP rank r publishes on port + r (tcp), ``_dp{r}`` suffix (inproc)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


@dataclass(slots=True)
class RankStats:
    endpoint: str
    last_seq: int | None = None
    connected: bool = False
    batches: int = 0
    decode_errors: int = 0
    gaps: int = 0
    replays: int = 0
    replay_timeouts: int = 0
    replayed_batches: int = 0
    replays_cut: int = 0  # replays stopped at replay_max_bytes (the rest counts as lost)
    lost_batches: int = 0  # gap batches neither live nor replayed
    duplicates: int = 0
    restarts: int = 0
    forced_reconnects: int = 0  # connections ZMQ dropped for good (oversized/broken frame)
    internal_errors: int = 0  # exceptions caught by the last-resort handler (bugs)


@dataclass(slots=True)
class _RankState:
    rank: int
    endpoint: str
    replay_endpoint: str | None
    stats: RankStats
    was_disconnected: bool = False
    reconnected: bool = False  # reconnected since the last applied frame
    dup_from: int = 0
    dup_until: int = -1
    retry_due_by: float | None = None  # monotonic time by which ZMQ should say it retries


class KVEventSubscriber:
    """Live + replayed KV events of one pod, applied through a ``PodIngestor``."""

    def __init__(
        self,
        pod_id: str,
        endpoint: str,
        replay_endpoint: str | None,
        keyer: BlockKeyer,
        store: IndexStore,
        metrics: EventMetrics | None = None,
        *,
        dp_size: int = 1,
        topic: str = "",
        map_capacity: int = DEFAULT_CAPACITY,
        replay_timeout_s: float = 2.0,
        replay_max_batches: int = 20_000,
        replay_max_bytes: int = MAX_REPLAY_BYTES,
        bootstrap_replay: bool = True,
        warm_start: bool = False,
        heartbeat_s: float = 5.0,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.pod_id = pod_id
        self.metrics = metrics if metrics is not None else EventMetrics()
        self.ingestor = PodIngestor(pod_id, keyer, store, self.metrics, map_capacity)
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.replay_max_batches = replay_max_batches
        self.replay_max_bytes = replay_max_bytes
        self.bootstrap_replay = bootstrap_replay
        self.warm_start = warm_start and replay_endpoint is not None
        self.warmed = asyncio.Event()  # every rank's start-up replay ended (or none was due)
        self._ranks_warming = dp_size if self.warm_start else 0
        if not self._ranks_warming:
            self.warmed.set()
        self.heartbeat_ms = int(heartbeat_s * 1000)
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()
        # The same native context through the blocking API (inproc endpoints need one
        # context), for the live sockets (``_run_rank``).
        self._sync_ctx = zmq.Context.shadow(self._ctx.underlying)
        self._ranks = [
            _RankState(
                rank=r,
                endpoint=offset_port(endpoint, r),
                replay_endpoint=offset_port(replay_endpoint, r) if replay_endpoint else None,
                stats=RankStats(endpoint=offset_port(endpoint, r)),
            )
            for r in range(dp_size)
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self._decode_errors = self.metrics.decode_errors.labels(pod=pod_id)

    @property
    def stats(self) -> dict[int, dict[str, object]]:
        """Per DP rank: endpoint, last seq, connection and counters."""
        return {st.rank: asdict(st.stats) for st in self._ranks}

    async def start(self) -> None:
        if self._tasks:
            return
        for st in self._ranks:
            name = f"kv-events:{self.pod_id}:{st.rank}"
            self._tasks.append(asyncio.create_task(self._run_rank(st), name=name))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run_rank(self, st: _RankState) -> None:
        """Read ``st``'s live stream (and its socket monitor) until cancelled.

        The SUB and monitor sockets are plain (blocking-API) sockets read without
        blocking when the loop says their descriptor is readable, not ``zmq.asyncio``
        sockets behind a ``Poller``: the asyncio wrapper creates futures, registers
        watchers and polls on every message. A one-block batch, received and applied,
        cost the loop 695-704 µs of CPU that way and 502-528 this way (the live line
        of ``kvgate bench index``; a message is one engine step's events, so a CPU
        fleet sends one or two per request). A ZMQ descriptor only says that
        something may have changed, so both sockets are drained, the monitor first
        (as the poller ordered them), whenever it fires and before each wait."""
        sub = self._sync_ctx.socket(zmq.SUB)
        for opt, value in (
            (zmq.LINGER, 0),
            (zmq.RCVHWM, 100_000),
            (zmq.MAXMSGSIZE, MAX_FRAME_BYTES),
            (zmq.RECONNECT_IVL, 100),
            (zmq.RECONNECT_IVL_MAX, 5_000),
            (zmq.HEARTBEAT_IVL, self.heartbeat_ms),
            (zmq.HEARTBEAT_TIMEOUT, 3 * self.heartbeat_ms),
        ):
            sub.setsockopt(opt, value)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
        )
        sub.connect(st.endpoint)
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        fds = [sub.getsockopt(zmq.FD), monitor.getsockopt(zmq.FD)]
        for fd in fds:
            loop.add_reader(fd, readable.set)
        try:
            if self.warm_start:
                await self._warm(st)
            handled = 0
            while True:
                while _has_message(monitor):
                    self._on_monitor(st, monitor.recv_multipart(zmq.NOBLOCK))
                if st.retry_due_by is not None:
                    self._reconnect_if_abandoned(st, sub)
                if _has_message(sub):
                    await self.handle_frames(sub.recv_multipart(zmq.NOBLOCK), st.rank)
                    handled += 1
                    if handled % _YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # a flood of events must not hold the loop
                    continue
                await _wait_readable(readable, st.retry_due_by)
        finally:
            for fd in fds:
                loop.remove_reader(fd)
            with contextlib.suppress(zmq.ZMQError):  # the context may already be gone
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _warm(self, st: _RankState) -> None:
        """Replay ``st``'s history from 0 before reading the live stream.

        The SUB socket is already connected, so live frames published meanwhile wait
        in it; those the replay covered are then dropped as duplicates."""
        try:
            # Holes are asked for again here, before /ready, rather than on the first
            # live frame under traffic.
            replayed = await self._replay_filled(st, 0)
            run = _contiguous_run(replayed)
            await self._apply_replayed(st, run, replayed)
            if run:
                # Only what the replay delivered is a duplicate: a forged seq that
                # slipped through then looks like a restart and is replayed away.
                st.dup_from, st.dup_until = run[0], run[-1]
        except Exception:  # a bad replay must not stop the live stream
            st.stats.internal_errors += 1
            log.exception("pod %s rank %d: start-up replay failed", self.pod_id, st.rank)
        finally:
            self._ranks_warming -= 1
            if self._ranks_warming <= 0:
                self.warmed.set()

    async def handle_frames(self, frames: list[bytes], rank: int = 0) -> None:
        """Handle one live message of ``rank`` (what the socket loop calls); never raises."""
        st = self._ranks[rank]
        try:
            await self._on_frames(st, frames)
        except Exception:  # never let one bad batch stop the stream
            st.stats.internal_errors += 1
            self._decode_error(st)
            log.exception("pod %s rank %d: event handling failed", self.pod_id, st.rank)

    def _on_monitor(self, st: _RankState, frames: list[bytes]) -> None:
        try:
            event = parse_monitor_message(frames)["event"]
        except Exception:  # a monitor frame we do not understand is not worth a crash
            return
        if event == zmq.EVENT_CONNECTED:
            st.stats.connected = True
            st.reconnected = st.was_disconnected
        elif event == zmq.EVENT_DISCONNECTED:
            st.stats.connected = False
            st.was_disconnected = True
            st.retry_due_by = time.monotonic() + _RETRY_GRACE_S
        if event in (zmq.EVENT_CONNECTED, zmq.EVENT_CONNECT_RETRIED):
            st.retry_due_by = None

    def _reconnect_if_abandoned(self, st: _RankState, sub: zmq.Socket[bytes]) -> None:
        """Reconnect ``sub`` once ZMQ let the grace pass without retrying itself."""
        if st.retry_due_by is None or time.monotonic() < st.retry_due_by:
            return
        st.retry_due_by = None
        st.stats.forced_reconnects += 1
        log.warning(
            "pod %s rank %d: ZMQ dropped the event stream (a frame over %d bytes or a "
            "broken one); reconnecting",
            self.pod_id,
            st.rank,
            MAX_FRAME_BYTES,
        )
        with contextlib.suppress(zmq.ZMQError):  # the endpoint may already be gone
            sub.disconnect(st.endpoint)
        sub.connect(st.endpoint)

    def _decode_error(self, st: _RankState) -> None:
        st.stats.decode_errors += 1
        self._decode_errors.inc()

    async def _on_frames(self, st: _RankState, frames: list[bytes]) -> None:
        frame = parse_live(frames)
        if frame is None:
            self._decode_error(st)
            return
        last, seq = st.stats.last_seq, frame.seq
        if last is None:
            start_from_zero = seq > 0 and self.bootstrap_replay
            await (self._catch_up(st, 0, frame) if start_from_zero else self._apply(st, frame))
        elif seq == last + 1:
            await self._apply(st, frame)
        elif st.dup_from <= seq <= st.dup_until:
            st.stats.duplicates += 1
        elif seq <= last or st.reconnected:
            await self._restart(st, frame)
        else:
            st.stats.gaps += 1
            self.metrics.seq_gaps.labels(pod=self.pod_id).inc()
            await self._catch_up(st, last + 1, frame)

    async def _apply(self, st: _RankState, frame: Frame) -> None:
        st.stats.last_seq = frame.seq
        st.stats.batches += 1
        st.reconnected = False
        if not await self.ingestor.apply_payload(frame.payload, st.rank):
            st.stats.decode_errors += 1

    async def _restart(self, st: _RankState, frame: Frame) -> None:
        log.warning(
            "pod %s rank %d: event seq went from %s to %d; engine restarted, dropping L0/L1",
            self.pod_id,
            st.rank,
            st.stats.last_seq,
            frame.seq,
        )
        st.stats.restarts += 1
        st.stats.last_seq = None
        st.dup_from, st.dup_until = 0, -1
        await self.ingestor.engine_restarted(st.rank)
        if frame.seq > 0:
            await self._catch_up(st, 0, frame)
        else:
            await self._apply(st, frame)

    async def _catch_up(self, st: _RankState, start: int, trigger: Frame) -> None:
        """Replay from ``start``, apply everything up to ``trigger`` in order."""
        replayed = await self._replay_filled(st, start, until=trigger.seq - 1)
        replayed.setdefault(trigger.seq, trigger.payload)
        if start > 0:  # from 0 is a bootstrap: earlier batches may simply be gone
            got = sum(1 for s in replayed if start <= s < trigger.seq)
            st.stats.lost_batches += trigger.seq - start - got
        # Only the gap up to the live trigger is trusted: a seq past it would become
        # ``last_seq`` and turn every later live batch into a "duplicate". Genuine
        # batches past the trigger are already queued on the SUB socket.
        first = start if st.stats.last_seq is None else max(start, st.stats.last_seq + 1)
        seqs = sorted(s for s in replayed if first <= s <= trigger.seq)
        await self._apply_replayed(st, seqs, replayed)
        st.dup_from, st.dup_until = 0, -1

    async def _apply_replayed(
        self, st: _RankState, seqs: list[int], replayed: dict[int, bytes]
    ) -> None:
        """Apply replayed batches in order, yielding to the event loop every
        ``_REPLAY_SLICE_S``: the memory index applies without suspending, and a pod's
        whole history (10,000 batches of a 1,600-token prompt each took 4.2 s here)
        would otherwise hold every request and probe for as long. A replay under
        traffic (a reconnect that looks like a restart, a pod added while serving)
        applies the same way."""
        slice_ends = time.monotonic() + _REPLAY_SLICE_S
        for seq in seqs:
            await self._apply(st, Frame(seq=seq, payload=replayed[seq]))
            if time.monotonic() >= slice_ends:
                await asyncio.sleep(0)
                slice_ends = time.monotonic() + _REPLAY_SLICE_S

    async def _replay_filled(
        self, st: _RankState, start: int, until: int | None = None
    ) -> dict[int, bytes]:
        """Replay from ``start``; while the replayed run stops at a hole with batches
        past it (up to ``until``, when given: later ones come live), ask again from the
        hole, ``_REFETCHES`` times at most.

        Holes are what the pod's ROUTER drops: it sends its whole buffer back to back
        and drops what is past its high-water mark, which a busy machine's ZMQ I/O
        thread does not always drain in time (one of two real pods' replays of 6,000
        batches lost 30-80 of them every time). A replay from 0 under traffic (a
        reconnect that looks like a restart) is as long as a start-up one."""
        replayed = await self._replay(st, start)
        for _ in range(_REFETCHES):
            run = _contiguous_run(replayed)
            top = max(replayed, default=-1)
            if until is not None:
                top = min(top, until)
            if not run or run[-1] >= top:
                break
            more = await self._replay(st, run[-1] + 1)
            if not more:
                break
            for seq, payload in more.items():
                replayed.setdefault(seq, payload)
        return replayed

    async def _replay(self, st: _RankState, start: int) -> dict[int, bytes]:
        if st.replay_endpoint is None:
            return {}
        st.stats.replays += 1
        self.metrics.replays.labels(pod=self.pod_id).inc()
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # vLLM sends its whole buffer back to back and its ROUTER drops what is past
        # its high-water mark (1,000 messages) instead of waiting: with ZMQ's default
        # 1,000 here too, a 10,000-batch history of ~1 KB batches (more than the
        # loopback's socket buffers) arrived 45% whole, its end marker lost, and the
        # first live frame then replayed the gap while requests were served (each
        # replay holds the pod's publisher thread for its whole buffer). Taking every
        # batch we would keep as it comes leaves nothing for the pod to drop. (ZMQ's
        # pipe counts messages, not bytes, at its default as here: what is kept is
        # bounded by ``replay_max_bytes``, and the pipe goes with the socket.)
        dealer.setsockopt(zmq.RCVHWM, self.replay_max_batches + 1)  # and the end marker
        dealer.connect(st.replay_endpoint)
        try:
            async with asyncio.timeout(self.replay_timeout_s * 10):
                # Received through the blocking API, drained without waiting while
                # messages are queued, as the live socket is: with an awaited poll and
                # receive per message, receiving a 10,000-batch history (~9 KiB a
                # batch) took 0.77 s here; drained, 0.18-0.25 s (``kvgate bench
                # index``'s warm-start line).
                receive = zmq.Socket.shadow(dealer.underlying).recv_multipart
                return await self._read_replay(st, dealer, receive, start)
        except TimeoutError:
            st.stats.replay_timeouts += 1
            return {}
        finally:
            dealer.close(linger=0)

    async def _read_replay(
        self,
        st: _RankState,
        dealer: zmq.asyncio.Socket,
        receive: Callable[[int], list[bytes]],
        start: int,
    ) -> dict[int, bytes]:
        """Replies until the end marker, an idle timeout, or the batch or byte bound.
        ``receive(zmq.NOBLOCK)`` takes a queued reply or raises ``zmq.Again``;
        ``dealer`` sends the request and is polled when nothing is queued."""
        await dealer.send_multipart(replay_request(start))
        out: dict[int, bytes] = {}
        held = 0  # payload bytes received (a seq sent twice counts twice: a bound)
        idle_ms = int(self.replay_timeout_s * 1000)
        received = 0
        while len(out) < self.replay_max_batches:
            if held >= self.replay_max_bytes:
                st.stats.replays_cut += 1
                break
            try:
                frames = receive(zmq.NOBLOCK)
            except zmq.Again:
                if not await dealer.poll(idle_ms, zmq.POLLIN):
                    st.stats.replay_timeouts += 1
                    break
                continue
            received += 1
            if received % _REPLAY_YIELD_EVERY == 0:
                await asyncio.sleep(0)  # other pods' streams and the server share the loop
            frame = parse_replay(frames)
            if frame is None:
                self._decode_error(st)
            elif frame.seq == END_SEQ:
                break
            else:
                out[frame.seq] = frame.payload
                held += len(frame.payload)
        st.stats.replayed_batches += len(out)
        return out
