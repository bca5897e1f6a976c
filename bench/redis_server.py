"""A real ``redis-server`` on a free loopback port, for tests and benchmarks.

Started in its own temp dir with persistence off (``--save '' --appendonly no``)
so a restart comes back empty, like a Redis that lost its data. ``kill`` sends
SIGKILL (a crash), ``stop`` a clean shutdown; ``start`` again reuses the port, so
clients holding the URL reconnect to the new process.

``RedisClusterServers`` is a real Redis Cluster (3 masters with a replica each) on
loopback, for the store's cluster tests and a master failover.

Tests use the ``redis_server``/``private_redis``/``redis_cluster`` fixtures in
``tests/conftest.py``; benchmarks use ``running_redis()``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator

import redis

from bench.polling import wait_for
from bench.ports import free_port, free_ports
from bench.processes import stop

REDIS_SERVER = shutil.which("redis-server")
SKIP_REASON = "redis-server not on PATH (apt-get install redis-server); CI installs it"


def _ping(port: int) -> bool:
    """Raw RESP PING, so the helper does not depend on the client under test."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError(SKIP_REASON)
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvgate-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 5.0) -> None:
        assert REDIS_SERVER is not None
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--dir", self.dir]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = self.proc

        def answers() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {proc.returncode} on port {self.port}"
                )
            return _ping(self.port)

        wait_for(answers, timeout_s, what=f"redis-server PING on port {self.port}", poll=0.01)

    def kill(self) -> None:
        """SIGKILL: a crash, connections drop without a goodbye."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: a hung server; connections stay open but nothing answers."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()
            stop(self.proc, grace_s=5)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


REDIS_CLI = shutil.which("redis-cli")
CLUSTER_SKIP_REASON = (
    "redis-server and redis-cli are needed for a Redis Cluster (apt-get install redis-server)"
)


class RedisClusterServers:
    """A real Redis Cluster on loopback: ``masters`` masters, one replica each.

    Nodes run with persistence off in one temp dir, ``cluster-node-timeout`` of
    ``node_timeout_ms`` (a killed master's replica takes over ~2-3 s later with 1 s),
    and explicit cluster-bus ports (picked free, like the client ports). The cluster
    is made by ``redis-cli --cluster create`` as an operator would."""

    def __init__(self, masters: int = 3, node_timeout_ms: int = 1000) -> None:
        if REDIS_SERVER is None or REDIS_CLI is None:
            raise RuntimeError(CLUSTER_SKIP_REASON)
        self.size = masters * 2
        ports = free_ports(self.size * 2)
        self.ports, self.bus_ports = ports[: self.size], ports[self.size :]
        self.node_timeout_ms = node_timeout_ms
        self.dir = tempfile.mkdtemp(prefix="kvgate-redis-cluster-")
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """A seed node's URL (the client finds the rest)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        assert REDIS_SERVER is not None and REDIS_CLI is not None
        for port, bus in zip(self.ports, self.bus_ports, strict=True):
            node_dir = os.path.join(self.dir, str(port))  # its own RDB for the replica sync
            os.makedirs(node_dir)
            args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                    "--cluster-enabled", "yes", "--cluster-port", str(bus),
                    "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", str(self.node_timeout_ms),
                    "--cluster-replica-validity-factor", "0",  # a replica may always take over
                    "--save", "", "--appendonly", "no", "--dir", node_dir]  # fmt: skip
            self.procs[port] = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        for port in self.ports:
            wait_for(lambda p=port: _ping(p), timeout_s, what=f"cluster node {port}", poll=0.01)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            [REDIS_CLI, "--cluster", "create", *nodes, "--cluster-replicas", "1",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=timeout_s,
        )  # fmt: skip
        wait_for(self.healthy, timeout_s, what="the Redis Cluster to be ok", poll=0.05)

    def _client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1.0, socket_connect_timeout=1.0)

    def healthy(self) -> bool:
        """Every live node says ``cluster_state:ok`` and every slot has a live master."""
        for port in self.procs:
            try:
                with self._client(port) as c:
                    if c.cluster("info")["cluster_state"] != "ok":
                        return False
            except (redis.RedisError, OSError):
                return False
        return True

    def master_of(self, slot: int) -> int:
        """The port of the master serving ``slot``, as a live node sees it."""
        for port in self.procs:
            try:
                with self._client(port) as c:
                    for start, end, master, *_ in c.execute_command("CLUSTER SLOTS"):
                        if start <= slot <= end:
                            return int(master[1])
            except (redis.RedisError, OSError):
                continue
        raise RuntimeError(f"no live node knows slot {slot}")

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash)."""
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait()

    def wait_failover(self, slot: int, old_master: int, timeout_s: float = 20.0) -> int:
        """Wait until a replica took over ``slot`` from ``old_master`` and the cluster
        is ok; the new master's port."""

        def promoted() -> int | None:
            with contextlib.suppress(RuntimeError):
                port = self.master_of(slot)
                if port != old_master and self.healthy():
                    return port
            return None

        return wait_for(promoted, timeout_s, what=f"a replica to take slot {slot}", poll=0.1)

    def cleanup(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def running_redis_cluster(masters: int = 3) -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers(masters)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.cleanup()
