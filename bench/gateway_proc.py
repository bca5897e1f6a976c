"""Run a real ``kvgate serve`` process on a free loopback port (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.ports import free_port


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def wait_ready(base_url: str, timeout: float = 30.0) -> None:
    """Wait until /ready says every configured model has a healthy pod."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/ready", timeout=1.0).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{base_url}/ready not 200 within {timeout}s")


@contextlib.contextmanager
def run_gateway(
    pods: list[tuple[str, str]],
    strategy: str = "round-robin",
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    ready: bool = True,
) -> Iterator[str]:
    """Start ``kvgate serve`` in front of ``pods`` ((name, url) pairs); yield its URL.

    ``pods`` entries may carry extra pod options after the URL, e.g.
    ``("a", "http://127.0.0.1:8001,events=tcp://127.0.0.1:5557")``.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--strategy", strategy, "--log-level", "warning"]
    for name, url in pods:
        cmd += ["--pod", f"{name}={url}"]
    cmd += extra_args or []
    log = tempfile.NamedTemporaryFile(prefix="kvgate-gw-", suffix=".log", delete=False)
    full_env = {**os.environ, "KVGATE_HEALTH__INTERVAL_S": "0.5", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{base}/health", proc=proc)
        if ready:
            wait_ready(base)
        yield base
    except Exception:
        print(Path(log.name).read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
