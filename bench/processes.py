"""Stopping a child process that benchmarks and tests started."""

from __future__ import annotations

import subprocess
from typing import Any


def stop(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` and wait up to ``grace_s`` for it to exit; SIGKILL it if it has
    not. A server draining its connections on a loaded machine can take longer than
    the grace; a benchmark stopped then must still leave nothing running."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
