"""Run simulated pods as real subprocesses on loopback, for tests and benchmarks.

Each pod is ``sys.executable -m bench.sim`` on a free port, so a gateway under
test talks to it over real HTTP/ZMQ exactly as it would to vLLM, and a test can
SIGKILL one and start it again on the same ports.

    with sim_fleet(3, l0_capacity_blocks=64, kv_events=True) as pods:
        ... pods[0].url, pods[0].events_endpoint, pods[0].replay_endpoint ...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.logfiles import log_file
from bench.polling import http_status, wait_for
from bench.ports import free_port
from bench.processes import stop

_SCALED = {
    "overhead_s": ("--overhead-ms", 1e3),
    "itl_s": ("--itl-ms", 1e3),
    "itl_per_seq_s": ("--itl-per-seq-ms", 1e3),
    "prefill_s_per_running": ("--prefill-ms-per-running", 1e3),
    "prefill_s_per_cached_token": ("--prefill-us-per-cached-token", 1e6),
    "l1_latency_s": ("--l1-latency-ms", 1e3),
    "l2_latency_s": ("--l2-latency-ms", 1e3),
    "l1_bandwidth_bytes_per_s": ("--l1-gb-per-s", 1e-9),
    "l2_bandwidth_bytes_per_s": ("--l2-gb-per-s", 1e-9),
}
_RENAMED = {"model": "--served-model-name"}
_EVENT_KEYS = ("kv_events", "kv_events_old_shape", "kv_events_bytes_hashes", "topic")


def _config_flags(overrides: dict[str, Any]) -> list[str]:
    """SimConfig field overrides → CLI flags (``itl_s=0.01`` → ``--itl-ms 10``)."""
    flags: list[str] = []
    for key, value in overrides.items():
        flag = _RENAMED.get(key, "--" + key.replace("_", "-"))
        if key in _SCALED:
            flag, scale = _SCALED[key]
            flags += [flag, repr(float(value) * scale)]
        elif isinstance(value, bool):  # a store_true flag
            flags += [flag] if value else []
        elif isinstance(value, tuple | list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


class SimPod:
    """One simulated pod subprocess; ``start``/``stop``/``kill`` keep its ports."""

    def __init__(self, name: str, overrides: dict[str, Any], events: dict[str, Any]) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events_endpoint: str | None = None
        self.replay_endpoint: str | None = None
        flags = ["--port", str(self.port), *_config_flags(overrides)]
        if events.get("kv_events"):
            flags += self._event_flags(events)
        self.args = flags
        self.log_path = log_file(f"kvgate-{name}-")
        self.process: subprocess.Popen[bytes] | None = None

    def _event_flags(self, events: dict[str, Any]) -> list[str]:
        pub, replay = free_port(), free_port()
        self.events_endpoint = f"tcp://127.0.0.1:{pub}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay}"
        cfg = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub}",  # '*' makes the publisher bind, as in vLLM
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": events.get("topic", "kv-events"),
        }
        flags = ["--kv-events-config", json.dumps(cfg)]
        if events.get("kv_events_old_shape"):
            flags.append("--kv-events-old-shape")
        if events.get("kv_events_bytes_hashes"):
            flags.append("--kv-events-bytes-hashes")
        return flags

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def spawn(self) -> None:
        """Start the process without waiting for it to serve."""
        if self.running:
            return
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bench.sim", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Poll /health until 200; fail at once with the log tail if the process exits."""

        def healthy() -> bool:
            if not self.running:
                raise RuntimeError(f"{self.name} exited; log {self.log_path}:\n{self.log_tail()}")
            return http_status(self.url + "/health") == 200

        what = f"{self.name} to be healthy (log {self.log_path})"
        wait_for(healthy, timeout, what=what, poll=0.05)

    def start(self, timeout: float = 30.0) -> SimPod:
        self.spawn()
        self.wait_healthy(timeout)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (uvicorn drains and exits), SIGKILL if it does not."""
        if not self.running:
            return
        assert self.process is not None
        stop(self.process, grace_s=timeout)

    def kill(self) -> None:
        """SIGKILL: the pod vanishes mid-whatever, like a crashed engine."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def start_sim_pods(n: int, **overrides: Any) -> list[SimPod]:
    """Start ``n`` pods in parallel and wait until all answer /health.

    ``overrides`` are SimConfig fields (``l0_capacity_blocks=8``, ``itl_s=0.01``,
    ``hash_seed="x"``) plus ``kv_events=True`` (free PUB/ROUTER ports),
    ``kv_events_old_shape``, ``kv_events_bytes_hashes`` and ``topic``.
    """
    events = {k: overrides.pop(k) for k in _EVENT_KEYS if k in overrides}
    pods = [SimPod(f"sim-{i}", overrides, events) for i in range(n)]
    try:
        for pod in pods:
            pod.spawn()
        for i, pod in enumerate(pods):
            pods[i] = _healthy_or_on_new_ports(pod, overrides, events)
    except BaseException:
        for pod in pods:
            pod.kill()
        raise
    return pods


def _healthy_or_on_new_ports(
    pod: SimPod, overrides: dict[str, Any], events: dict[str, Any], attempts: int = 3
) -> SimPod:
    """Wait for ``pod``; if one of its ports was taken meanwhile (another process on the
    machine picked it between our choice and the bind), start it again on new ports."""
    for attempt in range(attempts):
        try:
            pod.wait_healthy()
            return pod
        except RuntimeError as exc:
            if "already in use" not in str(exc) or attempt == attempts - 1:
                raise
            pod = SimPod(pod.name, overrides, events)
            pod.spawn()
    raise AssertionError("unreachable")


@contextmanager
def sim_fleet(n: int, **overrides: Any) -> Iterator[list[SimPod]]:
    """``start_sim_pods`` that stops every pod on exit."""
    pods = start_sim_pods(n, **overrides)
    try:
        yield pods
    finally:
        for pod in pods:
            pod.stop()
