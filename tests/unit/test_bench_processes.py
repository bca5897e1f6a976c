"""bench.processes.stop: a child that ignores SIGTERM is killed after the grace."""

import signal
import subprocess
import sys

from bench.processes import stop

# Prints once its handler is in place, so the test never signals it before that.
IGNORES_SIGTERM = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def _started(code: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_child_that_exits_on_sigterm_is_stopped_by_it():
    proc = _started("import time; print('ready', flush=True); time.sleep(60)")
    stop(proc, grace_s=10)
    assert proc.returncode == -signal.SIGTERM


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace():
    proc = _started(IGNORES_SIGTERM)
    stop(proc, grace_s=0.5)
    assert proc.returncode == -signal.SIGKILL
