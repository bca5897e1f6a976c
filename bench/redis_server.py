"""A real ``redis-server`` on a free loopback port, for tests and benchmarks.

Started in its own temp dir with persistence off (``--save '' --appendonly no``)
so a restart comes back empty, like a Redis that lost its data. ``kill`` sends
SIGKILL (a crash), ``stop`` a clean shutdown; ``start`` again reuses the port, so
clients holding the URL reconnect to the new process.

Tests use the ``redis_server``/``private_redis`` fixtures in ``tests/conftest.py``; benchmarks
use ``running_redis()``.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator

from bench.polling import wait_for
from bench.ports import free_port

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
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
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
