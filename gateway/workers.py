"""``kvgate serve --workers N``: N gateway processes on one port that route as one.

A kvgate process uses one core (one event loop; tokenization and the index walk are
CPU), so a host serves more with a process per core. The supervisor (this module, the
process ``kvgate serve`` started) maps the state the workers share, then forks them
and restarts any that dies. Each worker is a whole gateway (``gateway.state``): its
own pod registry, event subscribers and index, fed by the same ZMQ streams (a PUB
socket fans out to every subscriber), so their indexes agree. What one worker knows
and the others could not learn by themselves is shared on the host:

* in-flight load per pod: one shared-memory table, a column per worker
  (``gateway.host_load``), read as the host's sum: exact and immediate;
* speculative L0 entries (memory index) and KV events posted over HTTP: on the
  workers' rings (``gateway.host_bus``), read before every lookup;
* metrics: Prometheus's multiprocess mode (one file per worker in a temporary
  directory; ``/metrics`` on any worker sums them), so a scrape sees the host;
* with a Redis index, the index itself and (worker 0 only) the per-replica load
  published to the other replicas (``gateway.fleet_load``). Worker 0 alone writes
  KV events to Redis: the others' events would be the same writes again.

Calibration stays per worker: the kernel spreads connections evenly, so each worker
fits the same hardware from a uniform sample of the traffic.

Sockets: every worker listens on the serving port with its own ``SO_REUSEPORT``
socket (the kernel spreads connections over them evenly; one shared socket lets the
least busy process take most keep-alive connections), while the supervisor keeps a
bound, non-listening socket of that group so the port stays reserved between worker
restarts. A worker's socket starts listening only once its app has started (uvicorn
listens when it starts serving), so a restarting worker is handed no connections
while its siblings could serve them; before any worker is up, a connection is
refused rather than held. The admin listener is one socket, bound by the supervisor and served by
every worker: any worker can answer index questions, and an event batch posted to
one reaches the others over the bus.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.host_bus import HostBus
from gateway.host_load import HostLoadTable

log = logging.getLogger("kvgate.workers")

_CRASH_WINDOW_S = 10.0  # a worker that dies this soon after starting counts as a crash
_MAX_CRASHES = 5  # in a row, per worker: then the supervisor gives up


def default_workers() -> int:
    """One worker per core this process may use: the CPU affinity set, capped by a
    cgroup CPU quota (a Kubernetes CPU limit) when one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup (v2 ``cpu.max``, else v1 quota/period); None: no limit."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    with contextlib.suppress(OSError, ValueError):
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    return None


@dataclass
class WorkerContext:
    """What a worker process shares with its siblings; None for a single process."""

    index: int
    count: int
    host_id: str  # this host's (supervisor's) id; replicas tell each other apart by it
    load: HostLoadTable
    bus: HostBus
    metrics_dir: str

    @property
    def writes_shared_events(self) -> bool:
        """Whether this worker writes KV events to a shared (Redis) index: one per host."""
        return self.index == 0

    @property
    def publishes_fleet_load(self) -> bool:
        """Whether this worker exchanges the host's load with the other replicas."""
        return self.index == 0


def reuseport_socket(host: str, port: int, *, listen: bool) -> socket.socket:
    """A TCP socket bound with ``SO_REUSEPORT`` (one of a group sharing ``port``)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    if listen:
        sock.listen(2048)
    return sock


class Supervisor:
    """Forks ``count`` workers, restarts the ones that die, stops them all on a signal."""

    def __init__(
        self,
        count: int,
        run_worker: Callable[[WorkerContext], int],
        *,
        load_capacity: int = 1024,
        bus_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        if count < 2:
            raise ValueError("a supervisor runs two or more workers")
        self.count = count
        self.run_worker = run_worker
        self.host_id = secrets.token_hex(6)
        self.load = HostLoadTable(count, load_capacity)
        self.bus = HostBus(count, bus_bytes)
        self.metrics_dir = tempfile.mkdtemp(prefix="kvgate-metrics-")
        self._children: dict[int, int] = {}  # pid -> worker index
        self._started: dict[int, float] = {}  # worker index -> when it last started
        self._crashes: dict[int, int] = {}  # worker index -> crashes in a row
        self._stopping = False

    def context(self, index: int) -> WorkerContext:
        return WorkerContext(index, self.count, self.host_id, self.load, self.bus,
                             self.metrics_dir)  # fmt: skip

    def run(self) -> int:
        """Until SIGTERM/SIGINT (then the workers' exit status) or repeated crashes (1);
        SIGHUP is passed on to every worker (each reloads its settings)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self._forward)
        try:
            for i in range(self.count):
                self._spawn(i)
            return self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_all()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _spawn(self, index: int) -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the worker takes it
                code = self.run_worker(self.context(index))
            except BaseException:  # noqa: BLE001  (a worker must never return into the supervisor)
                log.exception("worker %d failed", index)
            finally:
                os._exit(code)
        self._children[pid] = index
        self._started[index] = time.monotonic()
        log.info("worker %d started (pid %d)", index, pid)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stopping = True
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def _forward(self, signum: int, _frame: object) -> None:
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _watch(self) -> int:
        status = 0
        while self._children:
            try:
                pid, raw = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:  # pragma: no cover  (PEP 475 retries os.wait)
                continue
            index = self._children.pop(pid, None)
            if index is None:
                continue
            code = os.waitstatus_to_exitcode(raw)
            self._reap(pid, index)
            if self._stopping:
                status = status or max(0, code)
                continue
            lived = time.monotonic() - self._started.get(index, 0.0)
            self._crashes[index] = self._crashes.get(index, 0) + 1 if lived < _CRASH_WINDOW_S else 1
            log.error("worker %d (pid %d) exited with %d after %.1f s", index, pid, code, lived)
            if self._crashes[index] > _MAX_CRASHES:
                log.error("worker %d keeps crashing; stopping", index)
                self._on_signal(signal.SIGTERM, None)
                status = 1
                continue
            time.sleep(min(5.0, 0.1 * 2 ** (self._crashes[index] - 1)))
            if not self._stopping:
                self._spawn(index)
        return status

    def _reap(self, pid: int, index: int) -> None:
        """A worker is gone: its requests and gauges with it; free what it held."""
        self.load.clear_worker(index)
        if self.load.repair_lock() or self.bus.repair_locks():
            log.warning("worker %d died holding a shared lock; released it", index)
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, self.metrics_dir)

    def _stop_all(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        while self._children and time.monotonic() < deadline:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.05)
                continue
            self._children.pop(pid, None)
        for pid in list(self._children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._children.clear()
