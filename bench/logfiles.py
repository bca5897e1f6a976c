"""Log files of the processes the benchmarks and tests start: gateways, simulated pods,
peer routers.

They go in one temporary folder per Python process, removed when that process exits.
A test suite starts hundreds of these processes, and a file of its own in /tmp for
each outlived every run (1,815 had gathered on the development machine). A process
that fails to start or dies is reported with its log's tail in the exception, so
what it said is not lost with the folder. ``KVGATE_KEEP_LOGS=1`` keeps the folder and
prints where it is.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

_folder: Path | None = None
_owner = 0  # the process that made the folder: a forked child must not remove it


def log_file(prefix: str) -> Path:
    """A new, empty log file named ``<prefix>...log`` in this process's log folder."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=_log_folder())
    os.close(fd)
    return Path(path)


def _log_folder() -> Path:
    global _folder, _owner
    if _folder is None or _owner != os.getpid() or not _folder.is_dir():
        _folder = Path(tempfile.mkdtemp(prefix="kvgate-logs-"))
        _owner = os.getpid()
        atexit.register(_remove, _folder, _owner)
    return _folder


def _remove(folder: Path, owner: int) -> None:
    if owner != os.getpid():
        return
    if os.environ.get("KVGATE_KEEP_LOGS"):
        print(f"kvgate: process logs kept in {folder}", file=sys.stderr)
        return
    shutil.rmtree(folder, ignore_errors=True)
