"""Messages between the worker processes of one host: one ring per worker in shared memory.

What one worker learns that its siblings' indexes need and cannot get elsewhere goes
on its ring: the speculative L0 entries of its own dispatches (memory index: without
them a burst of one new prompt, spread over the workers by the kernel, would be
prefilled once per worker) and the KV-event batches posted to it over HTTP (each
worker keeps a full index; ZMQ events reach every worker by themselves, an HTTP post
reaches one). Every worker reads the others' rings before each index lookup and every
few milliseconds in the background, so a speculation made by one worker is seen by a
request routed by another a moment later.

A ring has one writer (its worker) and a lock that also orders memory between the
processes; a reader copies what is new under the lock and parses it outside. A
reader that fell a whole ring behind skips to the end and counts the loss (harmless
for speculation, which expires anyway; an HTTP batch lost that way is counted).
A message larger than half a ring is refused and counted. A worker that dies holding
a lock leaves it to the supervisor's ``repair_locks`` (held longer than any
legitimate holder would).

Record: ``u32 length, u8 kind, payload``; ring header: ``u64 write position`` (bytes
ever written, so wrap-around is ``position % size``).
"""

from __future__ import annotations

import mmap
import multiprocessing
import struct
from collections.abc import Callable, Iterator

_HEADER = 64  # bytes before each ring's data (the write position, padded)
_RECORD = struct.Struct("<IB")
_LOCK_TIMEOUT_S = 0.2  # a publisher or reader gives up (counted) rather than wait longer
_REPAIR_AFTER_S = 1.0  # the supervisor: no legitimate holder keeps a lock this long


class HostBus:
    """The rings; create before forking, then each worker takes ``endpoint(i)``."""

    def __init__(self, workers: int, ring_bytes: int = 4 * 1024 * 1024) -> None:
        if workers < 1 or ring_bytes < 4096:
            raise ValueError("workers >= 1 and ring_bytes >= 4096")
        self.workers = workers
        self.ring_bytes = ring_bytes
        self._mm = mmap.mmap(-1, workers * (_HEADER + ring_bytes))
        ctx = multiprocessing.get_context("fork")
        self.locks = [ctx.Lock() for _ in range(workers)]

    @property
    def nbytes(self) -> int:
        return len(self._mm)

    def _base(self, worker: int) -> int:
        return worker * (_HEADER + self.ring_bytes)

    def write_position(self, worker: int) -> int:
        return int.from_bytes(self._mm[self._base(worker) : self._base(worker) + 8], "little")

    def endpoint(self, worker: int) -> BusEndpoint:
        return BusEndpoint(self, worker)

    def repair_locks(self) -> int:
        """Release locks a dead worker left held; how many there were."""
        repaired = 0
        for lock in self.locks:
            if lock.acquire(timeout=_REPAIR_AFTER_S):
                lock.release()
            else:
                lock.release()
                repaired += 1
        return repaired

    # -- under the ring's lock ----------------------------------------------------------

    def _append(self, worker: int, record: bytes) -> None:
        base = self._base(worker)
        wp = int.from_bytes(self._mm[base : base + 8], "little")
        size = self.ring_bytes
        at = wp % size
        first = min(len(record), size - at)
        data = base + _HEADER
        self._mm[data + at : data + at + first] = record[:first]
        if first < len(record):
            self._mm[data : data + len(record) - first] = record[first:]
        self._mm[base : base + 8] = (wp + len(record)).to_bytes(8, "little")

    def _copy(self, worker: int, start: int, end: int) -> bytes:
        size = self.ring_bytes
        data = self._base(worker) + _HEADER
        a, b = start % size, end % size
        if end - start == 0:
            return b""
        if a < b:
            return self._mm[data + a : data + b]
        return self._mm[data + a : data + size] + self._mm[data : data + b]


class BusEndpoint:
    """One worker's side: publish on its own ring, read everyone else's."""

    def __init__(self, bus: HostBus, worker: int) -> None:
        self.bus = bus
        self.worker = worker
        # Start at the others' current ends: a (re)started worker has nothing to catch up.
        self._read = {w: bus.write_position(w) for w in range(bus.workers) if w != worker}
        self._handlers: dict[int, Callable[[int, bytes], None]] = {}
        self.published = 0
        self.refused = 0  # too large for the ring, or its lock not had in time
        self.received = 0
        self.overruns = 0  # times a reader fell a ring behind and skipped
        self.bad = 0  # messages a handler could not take (counted, skipped)

    def on(self, kind: int, handler: Callable[[int, bytes], None]) -> None:
        """Call ``handler(sender, payload)`` for every message of ``kind`` drained."""
        self._handlers[kind] = handler

    def publish(self, kind: int, payload: bytes) -> bool:
        if self.bus.workers < 2:
            return True
        record = _RECORD.pack(len(payload), kind) + payload
        lock = self.bus.locks[self.worker]
        if len(record) > self.bus.ring_bytes // 2 or not lock.acquire(timeout=_LOCK_TIMEOUT_S):
            self.refused += 1
            return False
        try:
            self.bus._append(self.worker, record)
        finally:
            lock.release()
        self.published += 1
        return True

    def drain(self) -> int:
        """Hand every new message of the other workers to its handler; how many."""
        handled = 0
        for sender, payload_kind, payload in self._new():
            handler = self._handlers.get(payload_kind)
            try:
                if handler is None:
                    raise ValueError(f"no handler for message kind {payload_kind}")
                handler(sender, payload)
            except Exception:  # noqa: BLE001  (a bad message must not fail a lookup)
                self.bad += 1
            handled += 1
        self.received += handled
        return handled

    def _new(self) -> Iterator[tuple[int, int, bytes]]:
        bus = self.bus
        for sender, start in self._read.items():
            if bus.write_position(sender) == start:  # unlocked peek: nothing new
                continue
            lock = bus.locks[sender]
            if not lock.acquire(timeout=_LOCK_TIMEOUT_S):
                continue
            try:
                end = bus.write_position(sender)
                if end - start > bus.ring_bytes:
                    self.overruns += 1
                    chunk = b""
                else:
                    chunk = bus._copy(sender, start, end)
            finally:
                lock.release()
            self._read[sender] = end
            yield from _records(sender, chunk)


def _records(sender: int, chunk: bytes) -> Iterator[tuple[int, int, bytes]]:
    at = 0
    while at + _RECORD.size <= len(chunk):
        length, kind = _RECORD.unpack_from(chunk, at)
        at += _RECORD.size
        yield sender, kind, chunk[at : at + length]
        at += length
