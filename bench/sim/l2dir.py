"""L2 on disk: a directory every simulated pod of a fleet shares, one file per block.

Like LMCache ``fs://`` on a shared mount (or vLLM's native filesystem tier), a block
lives in a small file named by its hash (hex), which every pod computes alike
because the fleet shares one hash seed. Writes are atomic (temp file + rename), so
a reader never sees half a file; readers check presence on the filesystem itself,
never a private mirror, so pod B finds what pod A wrote.

Capacity: the directory holds at most ``capacity`` files. A writer that may have
pushed it over (its own count since the last sweep says so, or every
``sweep_every`` writes, to notice other writers) scans it and deletes the least
recently used files (oldest mtime; a hit touches its files) down to 90% of the
capacity, so scans stay rare. The file's content is the writer's pod name, which
lets a reader count cross-pod hits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from bench.sim.cache import InsertResult

_LOW_WATER = 0.9  # a sweep trims to this fraction of the capacity


class DirL2:
    """The fleet-shared L2 tier as a directory (implements ``bench.podmodel.L2Store``)."""

    def __init__(self, root: Path, capacity: int, sweep_every: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.sweep_every = sweep_every or max(1, capacity // 10)
        self._estimate = self._count()  # files in the directory, as far as we know
        self._since_sweep = 0
        self._tmp_prefix = f".tmp-{os.getpid()}-"
        self.errors = 0  # I/O failures, counted and skipped (a lost write is a miss)

    def __len__(self) -> int:
        return self._count()

    def _path(self, key: bytes) -> str:
        return os.path.join(self.root, key.hex())

    def held(self, keys: Sequence[bytes], start: int) -> int:  # type: ignore[override]
        """Consecutive blocks present on disk from ``keys[start]`` on."""
        n = 0
        exists = os.path.exists
        for key in keys[start:]:
            if not exists(self._path(key)):
                break
            n += 1
        return n

    def writers(self, keys: Sequence[bytes]) -> list[str]:
        """The pod that wrote each block ('' where the file is gone or unreadable)."""
        out: list[str] = []
        for key in keys:
            try:
                with open(self._path(key), "rb") as f:
                    out.append(f.read(256).decode("utf-8", "replace"))
            except OSError:
                out.append("")
        return out

    def put(self, keys: Sequence[bytes], writer: str) -> InsertResult:  # type: ignore[override]
        """Write missing blocks atomically; touch present ones. May trigger a sweep."""
        result = InsertResult()
        data = writer.encode("utf-8")
        for key in keys:
            path = self._path(key)
            if os.path.exists(path):
                self._touch(path)
                continue
            tmp = os.path.join(self.root, self._tmp_prefix + key.hex())
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except OSError:
                self.errors += 1
                continue
            result.stored.append(key)
        self._estimate += len(result.stored)
        self._since_sweep += len(result.stored)
        if self._estimate > self.capacity or self._since_sweep >= self.sweep_every:
            result.evicted = self.sweep()
            if result.evicted:
                gone = set(result.evicted)
                result.stored = [k for k in result.stored if k not in gone]
        result.held = len(result.stored)
        return result

    def touch(self, keys: Sequence[bytes]) -> None:  # type: ignore[override]
        for key in keys:
            self._touch(self._path(key))

    def _touch(self, path: str) -> None:
        try:
            os.utime(path)
        except OSError:
            pass  # evicted by another pod meanwhile: nothing to keep warm

    def _entries(self) -> list[tuple[float, str]]:
        out: list[tuple[float, str]] = []
        with os.scandir(self.root) as it:
            for entry in it:
                if entry.name.startswith("."):
                    continue  # another writer's temp file
                try:
                    out.append((entry.stat().st_mtime, entry.name))
                except OSError:
                    continue
        return out

    def _count(self) -> int:
        with os.scandir(self.root) as it:
            return sum(1 for e in it if not e.name.startswith("."))

    def sweep(self) -> list[bytes]:
        """Delete least recently used files down to the low-water mark; returns their keys."""
        self._since_sweep = 0
        entries = self._entries()
        self._estimate = len(entries)
        if len(entries) <= self.capacity:
            return []
        entries.sort()
        excess = len(entries) - int(self.capacity * _LOW_WATER)
        evicted: list[bytes] = []
        for _, name in entries[:excess]:
            try:
                os.unlink(os.path.join(self.root, name))
                evicted.append(bytes.fromhex(name))
            except (OSError, ValueError):
                continue  # removed by another pod, or not one of ours
        self._estimate -= len(evicted)
        return evicted
