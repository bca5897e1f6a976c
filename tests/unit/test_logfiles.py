"""Started processes' logs live in one folder per Python process, gone when it exits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.logfiles import log_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
from bench.logfiles import log_file
a, b = log_file("kvgate-gw-"), log_file("kvgate-sim-0-")
a.write_text("started")
print(a, b, sep="\\n")
"""


def _run(env: dict[str, str]) -> tuple[list[Path], str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={**os.environ, **env})  # fmt: skip
    return [Path(line) for line in out.stdout.split()], out.stderr


def test_a_process_logs_go_in_one_folder_removed_when_it_exits():
    (gateway, pod), _ = _run({"KVGATE_KEEP_LOGS": ""})
    assert gateway.parent == pod.parent
    assert gateway.name.startswith("kvgate-gw-") and gateway.suffix == ".log"
    assert gateway.parent.name.startswith("kvgate-logs-")
    assert not gateway.parent.exists()


def test_kvgate_keep_logs_keeps_the_folder_and_says_where():
    (gateway, _), err = _run({"KVGATE_KEEP_LOGS": "1"})
    try:
        assert gateway.read_text() == "started"
        assert str(gateway.parent) in err
    finally:
        for f in gateway.parent.iterdir():
            f.unlink()
        gateway.parent.rmdir()


def test_each_log_is_a_new_empty_file():
    a, b = log_file("kvgate-x-"), log_file("kvgate-x-")
    assert a != b and a.parent == b.parent
    assert a.read_bytes() == b"" and b.read_bytes() == b""
