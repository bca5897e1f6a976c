"""Per-pod in-flight load shared by the worker processes of one host (``--workers N``).

Each worker counts the requests it dispatched in its own column of a table in shared
memory (mapped by the supervisor before it forks the workers); reading a pod's load
sums every worker's column, so all workers route on the host's exact load, at once,
with no message passing. A counter has one writer (its worker), so updates need no
lock: an aligned 8-byte store is atomic. A lock guards only the rare insertion of a
pod into the table.

The table also holds the load that the *other* replicas dispatched (the ``remote``
columns), written by the worker that talks to Redis for the host
(``gateway.fleet_load``) and ignored once older than its lease, so a host whose
publisher stalls routes on its own load rather than on stale numbers.

Pods are keyed by a 63-bit xxh3 of their name (the same key every replica uses in
Redis). The table has a fixed capacity; when it is full, a pod with no load anywhere
gives up its row. A worker that exits is zeroed by the supervisor (its requests died
with it).

Layout, all 8-byte signed words: ``keys[C]``, ``remote_as_of_ns``,
``remote[C][3]``, ``local[C][3][W]`` (worker columns of one counter side by side, so
a pod's load is three slice sums).
"""

from __future__ import annotations

import mmap
import multiprocessing
import struct
import time
from collections.abc import Mapping

import xxhash

from kvindex.types import Bound
from routing.load import InFlight, LoadTracker, PodLoad

FIELDS = 3  # in_flight, prefill_tokens, prefilling
_LOCK_TIMEOUT_S = 0.2  # legitimate holders keep the lock for microseconds
_REPAIR_AFTER_S = 1.0  # the supervisor: a lock held this long has a dead holder


def pod_key(pod: str) -> int:
    """The pod's key in shared tables and in Redis: 63 bits of xxh3, never 0."""
    return (xxhash.xxh3_64_intdigest(pod.encode()) >> 1) | 1


class HostLoadTable:
    """The shared table; create it before forking, then each worker takes ``view(i)``."""

    def __init__(self, workers: int, capacity: int = 1024) -> None:
        if workers < 1 or capacity < 1:
            raise ValueError("workers and capacity must be >= 1")
        self.workers = workers
        self.capacity = capacity
        self._remote_at = capacity  # word index of remote_as_of_ns
        self._remote = capacity + 1
        self._local = self._remote + capacity * FIELDS
        words = self._local + capacity * FIELDS * workers
        self._mm = mmap.mmap(-1, words * 8)  # anonymous, MAP_SHARED: inherited by fork
        self.words = memoryview(self._mm).cast("q")
        self.lock = multiprocessing.get_context("fork").Lock()
        self._row_counts = struct.Struct(f"={FIELDS * workers}q")  # one row, one C call
        self._remote_counts = struct.Struct(f"={FIELDS}q")

    @property
    def nbytes(self) -> int:
        return len(self._mm)

    @property
    def row_bytes(self) -> int:
        """Shared memory per pod row (the whole table is mapped up front)."""
        return 8 * (1 + FIELDS + FIELDS * self.workers)

    # -- rows ------------------------------------------------------------------------

    def find(self, key: int) -> int | None:
        """The row of ``key``, or None (a C-speed search of the key words)."""
        needle = struct.pack("=q", key)
        end = self.capacity * 8
        at = self._mm.find(needle, 0, end)
        while at >= 0 and at % 8:
            at = self._mm.find(needle, at + 1, end)
        return at // 8 if at >= 0 else None

    def find_or_insert(self, key: int) -> int | None:
        """The row of ``key``, taking a free (or idle) row if it has none; None: full."""
        row = self.find(key)
        if row is not None:
            return row
        if not self.lock.acquire(timeout=_LOCK_TIMEOUT_S):
            return None
        try:
            row = self.find(key)  # another worker may have inserted it meanwhile
            if row is None:
                row = self.find(0)
                if row is None:
                    row = self._idle_row()
                if row is not None:
                    self.words[row] = key
            return row
        finally:
            self.lock.release()

    def _idle_row(self) -> int | None:
        """A row whose pod has no load on any worker nor remotely: it may be reused."""
        w = self.words
        for row in range(self.capacity):
            lo = self._local + row * FIELDS * self.workers
            r = self._remote + row * FIELDS
            if not any(w[lo : lo + FIELDS * self.workers]) and not any(w[r : r + FIELDS]):
                return row
        return None

    def key_at(self, row: int) -> int:
        return self.words[row]

    # -- counters ---------------------------------------------------------------------

    def local_index(self, row: int, field: int, worker: int) -> int:
        return self._local + (row * FIELDS + field) * self.workers + worker

    def host_load(self, row: int) -> PodLoad:
        """Every worker's counts of ``row`` added up."""
        n = self.workers
        v = self._row_counts.unpack_from(self._mm, 8 * (self._local + row * FIELDS * n))
        return PodLoad(sum(v[:n]), sum(v[n : 2 * n]), sum(v[2 * n :]))

    def load(self, row: int, max_age_s: float) -> PodLoad:
        """``host_load`` plus ``remote_load`` (when fresh), read in two C calls."""
        n = self.workers
        v = self._row_counts.unpack_from(self._mm, 8 * (self._local + row * FIELDS * n))
        a, b, c = sum(v[:n]), sum(v[n : 2 * n]), sum(v[2 * n :])
        as_of = self.words[self._remote_at]
        if as_of and time.monotonic_ns() - as_of <= max_age_s * 1e9:
            ra, rb, rc = self._remote_counts.unpack_from(self._mm, 8 * (self._remote + row * 3))
            return PodLoad(a + ra, b + rb, c + rc)
        return PodLoad(a, b, c)

    def remote_load(self, row: int, max_age_s: float) -> PodLoad | None:
        """Other replicas' counts of ``row`` as last published, unless older than
        ``max_age_s``."""
        as_of = self.words[self._remote_at]
        if not as_of or time.monotonic_ns() - as_of > max_age_s * 1e9:
            return None
        return PodLoad(*self._remote_counts.unpack_from(self._mm, 8 * (self._remote + row * 3)))

    def set_remote(self, loads: Mapping[int, PodLoad]) -> None:
        """Replace the other replicas' counts (keyed by ``pod_key``), stamped now."""
        w = self.words
        seen = set()
        for key, load in loads.items():
            row = self.find_or_insert(key)
            if row is None:
                continue
            seen.add(row)
            r = self._remote + row * FIELDS
            w[r], w[r + 1], w[r + 2] = load.in_flight, load.prefill_tokens, load.prefilling
        for row in range(self.capacity):
            r = self._remote + row * FIELDS
            if row not in seen and (w[r] or w[r + 1] or w[r + 2]):
                w[r] = w[r + 1] = w[r + 2] = 0
        w[self._remote_at] = time.monotonic_ns()

    def host_totals(self) -> dict[int, PodLoad]:
        """Per pod key, the host's own load (all workers), busy pods only: what the
        host publishes to the other replicas."""
        out: dict[int, PodLoad] = {}
        for row in range(self.capacity):
            key = self.words[row]
            if key:
                load = self.host_load(row)
                if not load.idle:
                    out[key] = load
        return out

    def clear_worker(self, worker: int) -> None:
        """Zero a worker's column: it exited, and its requests with it."""
        for row in range(self.capacity):
            for field in range(FIELDS):
                self.words[self.local_index(row, field, worker)] = 0

    def repair_lock(self) -> bool:
        """Release the insertion lock if a worker died holding it (no legitimate holder
        keeps it for ``_REPAIR_AFTER_S``). True if it had to."""
        if self.lock.acquire(timeout=_REPAIR_AFTER_S):
            self.lock.release()
            return False
        self.lock.release()
        return True

    def view(self, worker: int, remote_max_age_s: float = 1.0) -> HostLoad:
        return HostLoad(self, worker, remote_max_age_s)


class _Counters:
    """One worker's counters of one row: the ``LoadCell`` its requests move."""

    __slots__ = ("_w", "_i")

    def __init__(self, table: HostLoadTable, row: int, worker: int) -> None:
        self._w = table.words
        self._i = tuple(table.local_index(row, f, worker) for f in range(FIELDS))

    def add(self, in_flight: int, prefill_tokens: int, prefilling: int) -> None:
        w = self._w
        a, b, c = self._i
        w[a] = max(0, w[a] + in_flight)
        w[b] = max(0, w[b] + prefill_tokens)
        w[c] = max(0, w[c] + prefilling)


class HostLoad:
    """One worker's ``LoadView`` of the table: it counts in its own column and reads
    the host's total plus the other replicas' (when fresh)."""

    def __init__(self, table: HostLoadTable, worker: int, remote_max_age_s: float) -> None:
        self.table = table
        self.worker = worker
        self.remote_max_age_s = remote_max_age_s
        self._rows: dict[str, tuple[int, int]] = {}  # pod -> (row, key); bounded below
        self._overflow = LoadTracker()  # pods the full table has no row for
        self.overflowed = 0

    def _row(self, pod: str) -> int | None:
        cached = self._rows.get(pod)
        if cached is not None and self.table.key_at(cached[0]) == cached[1]:
            return cached[0]
        key = pod_key(pod)
        row = self.table.find_or_insert(key)
        if row is None:
            return None
        if len(self._rows) >= 2 * self.table.capacity:
            self._rows.clear()
        self._rows[pod] = (row, key)
        return row

    def get(self, pod: str) -> PodLoad:
        row = self._row(pod)
        if row is None:
            return self._overflow.get(pod)
        return self.table.load(row, self.remote_max_age_s)

    def start(self, pod: str, prefill_tokens: int = 0) -> InFlight:
        row = self._row(pod)
        if row is None:
            self.overflowed += 1
            return self._overflow.start(pod, prefill_tokens)
        return InFlight(_Counters(self.table, row, self.worker), prefill_tokens)

    def forget(self, pod: str) -> None:
        """Rows are shared: a pod's row is reused once it is idle everywhere."""
        self._rows.pop(pod, None)
        self._overflow.forget(pod)

    def __contains__(self, pod: object) -> bool:
        return pod in self._rows or pod in self._overflow

    def bound(self) -> Bound:
        """Rows of the shared table in use (pods any worker or replica counted)."""
        used = sum(1 for row in range(self.table.capacity) if self.table.key_at(row))
        return Bound(used, self.table.capacity, "pods", self.table.row_bytes)
