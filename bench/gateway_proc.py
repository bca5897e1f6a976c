"""Run a real ``kvgate serve`` process on a free loopback port (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from bench.logfiles import log_file
from bench.polling import http_status, wait_for
from bench.ports import free_port, free_ports  # noqa: F401  (free_port: tests import it here)
from bench.processes import stop


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Wait until ``url`` answers below 500; fail at once if ``proc`` exits first."""

    def answered() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        status = http_status(url)
        return status is not None and status < 500

    wait_for(answered, timeout, what=f"{url} to answer", poll=0.1)


def wait_ready(base_url: str, timeout: float = 30.0) -> None:
    """Wait until /ready says every configured model has a healthy pod."""
    url = f"{base_url}/ready"
    wait_for(lambda: http_status(url) == 200, timeout, what=f"{url} to be 200", poll=0.1)


class GatewayURL(str):
    """The gateway's base URL (a plain ``str``), carrying its admin listener's URL, its
    process id (with ``--workers`` > 1, the supervisor's) and the file it logs to."""

    admin: str
    pid: int
    log: Path | None

    def __new__(cls, url: str, admin: str, pid: int = 0, log: Path | None = None) -> GatewayURL:
        obj = super().__new__(cls, url)
        obj.admin = admin
        obj.pid = pid
        obj.log = log
        return obj


@contextlib.contextmanager
def run_gateway(
    pods: list[tuple[str, str]],
    strategy: str | None = "round-robin",
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    ready: bool = True,
    workers: int = 1,
    port: int | None = None,
) -> Iterator[GatewayURL]:
    """Start ``kvgate serve`` in front of ``pods`` ((name, url) pairs); yield its URL
    (``.admin``: the admin listener's, on loopback).

    ``workers``: worker processes (``--workers``); 1 unless asked, so tests and
    benchmarks do not start one per core. ``port``: a fixed port (a restarted replica).
    ``strategy`` None: no ``--strategy`` flag (the config file's or the default).

    ``pods`` entries may carry extra pod options after the URL, e.g.
    ``("a", "http://127.0.0.1:8001,events=tcp://127.0.0.1:5557")``.
    """
    picked = [p for p in free_ports(2) if p != port]  # distinct: two free_port() may agree
    port, admin_port = port or picked[0], picked[-1]
    cmd = [sys.executable, "-m", "cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--admin-port", str(admin_port), "--workers", str(workers)]
    cmd += ["--log-level", "warning"] + (["--strategy", strategy] if strategy else [])
    for name, url in pods:
        cmd += ["--pod", f"{name}={url}"]
    cmd += extra_args or []
    log = log_file("kvgate-gw-").open("wb")
    full_env = {**os.environ, "KVGATE_HEALTH__INTERVAL_S": "0.5", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    base = GatewayURL(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}", proc.pid,
                      Path(log.name))  # fmt: skip
    try:
        wait_http(f"{base}/health", proc=proc)
        if ready:
            wait_ready(base)
        yield base
    except Exception:
        print(Path(log.name).read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        stop(proc)
        log.close()
