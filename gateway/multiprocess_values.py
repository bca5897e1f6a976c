"""Prometheus multiprocess values that reach their file in batches (``--workers``).

With ``--workers N`` each worker's metrics live in a file of its own (prometheus_client's
multiprocess mode), so that ``/metrics`` on any worker sums the host. prometheus_client's
own value writes its file at every update: a histogram observation is two writes into
the memory-mapped file under a lock, 2.25 µs against 1.17 for an in-process value, and
a worker makes ~16 updates a request (docs/performance.md, "Metrics written in
batches"). Batched, an observation takes 1.39 µs.

``BatchedValues`` makes an update change the value in memory and mark it; ``flush``
writes the marked ones. A worker flushes every ``FLUSH_EVERY_S`` from its event loop,
before it collects a scrape, and when it stops (``BatchedValues.run``). So a scrape sees
a sibling worker's updates up to ``FLUSH_EVERY_S`` late, and a worker killed outright
loses its last interval's, which its files would otherwise have kept.

The file format, the process's file names and what prometheus_client's
``MultiProcessCollector`` reads stay prometheus_client's own (``MmapedDict``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from threading import Lock
from typing import Any

from prometheus_client.mmap_dict import MmapedDict, mmap_key

# 10 flushes a second cost ~0.1% of a core under load (a flush writes each marked value
# once, however many requests updated it); a scrape comes every 15-60 s.
FLUSH_EVERY_S = 0.1


class BatchedValues:
    """The values of one process, and the class prometheus_client makes them from
    (``value_class``, put in ``prometheus_client.values.ValueClass``)."""

    def __init__(self, directory: str, process_identifier: Callable[[], int]) -> None:
        self._directory = directory
        self._process = process_identifier
        self._pid = process_identifier()
        # One lock for all, as prometheus_client's: a value is updated from the event
        # loop, but may be from another thread, and a flush reads them all.
        self._lock = Lock()
        self._files: dict[str, MmapedDict] = {}
        self._values: list[Any] = []
        self._marked: list[Any] = []
        self.value_class = self._make_class()

    def _make_class(self) -> type:
        values = self

        class BatchedMmapedValue:
            """A float kept in memory, written to this process's file by ``flush``."""

            _multiprocess = True

            def __init__(
                self,
                typ: str,
                metric_name: str,
                name: str,
                labelnames: list[str],
                labelvalues: list[str],
                help_text: str,
                multiprocess_mode: str = "",
                **kwargs: Any,
            ) -> None:
                self._params = typ, metric_name, name, labelnames, labelvalues, help_text
                self._mode = multiprocess_mode
                self._marked = False
                with values._lock:
                    values._check_for_fork()
                    values._open(self)
                    values._values.append(self)

            def inc(self, amount: float) -> None:
                with values._lock:
                    values._check_for_fork()
                    self._value += amount
                    self._timestamp = 0.0
                    if not self._marked:
                        self._marked = True
                        values._marked.append(self)

            def set(self, value: float, timestamp: float | None = None) -> None:
                with values._lock:
                    values._check_for_fork()
                    self._value = value
                    self._timestamp = timestamp or 0.0
                    if not self._marked:
                        self._marked = True
                        values._marked.append(self)

            def set_exemplar(self, exemplar: object) -> None:
                return  # prometheus_client's multiprocess mode keeps no exemplars

            def get(self) -> float:
                with values._lock:
                    values._check_for_fork()
                    return float(self._value)

            def get_exemplar(self) -> None:
                return None

        return BatchedMmapedValue

    def _open(self, value: Any) -> None:
        """Point ``value`` at its place in this process's file and read it from there
        (0 for a new one). The lock is held."""
        typ, metric_name, name, labelnames, labelvalues, help_text = value._params
        prefix = f"{typ}_{value._mode}" if typ == "gauge" else typ
        if prefix not in self._files:
            path = os.path.join(self._directory, f"{prefix}_{self._pid}.db")
            self._files[prefix] = MmapedDict(path)
        value._file = self._files[prefix]
        value._key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
        value._value, value._timestamp = value._file.read_value(value._key)
        value._marked = False

    def _check_for_fork(self) -> None:
        """A forked child writes files of its own, starting from zero, as
        prometheus_client's values do: what the parent had marked is the parent's."""
        pid = self._process()
        if pid == self._pid:
            return
        self._pid = pid
        for file in self._files.values():
            file.close()
        self._files.clear()
        self._marked.clear()
        for value in self._values:
            self._open(value)

    def flush(self) -> int:
        """Write every value updated since the last flush to the file; how many."""
        with self._lock:
            self._check_for_fork()
            marked, self._marked = self._marked, []
            for value in marked:
                value._file.write_value(value._key, value._value, value._timestamp)
                value._marked = False
            return len(marked)

    async def run(self) -> None:
        """Flush every ``FLUSH_EVERY_S`` until cancelled, and once more then."""
        try:
            while True:
                await asyncio.sleep(FLUSH_EVERY_S)
                self.flush()
        finally:
            self.flush()


class FlushedFirst:
    """A collector that flushes this process's values before ``inner`` reads the files,
    so a scrape sees all of its own worker's updates."""

    def __init__(self, inner: Any, flush: Callable[[], object]) -> None:
        self._inner = inner
        self._flush = flush

    def collect(self) -> Iterator[Any]:
        self._flush()
        yield from self._inner.collect()


_active: BatchedValues | None = None


def use_batched_values(directory: str, process_identifier: Callable[[], int]) -> BatchedValues:
    """Make the metrics created from now on in this process ``BatchedValues`` of
    ``directory``."""
    global _active
    from prometheus_client import values

    _active = BatchedValues(directory, process_identifier)
    values.ValueClass = _active.value_class
    return _active


def batched_values() -> BatchedValues | None:
    """This process's ``BatchedValues``, if its metrics are batched."""
    return _active
