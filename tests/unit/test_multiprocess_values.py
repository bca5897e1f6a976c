"""``--workers``' metrics, written to the worker's multiprocess file in batches
(``gateway.multiprocess_values``): an update stays in memory until a flush, a scrape
through ``FlushedFirst`` sees its own process's at once, and what prometheus_client's
``MultiProcessCollector`` sums across processes is unchanged."""

from __future__ import annotations

import asyncio
import multiprocessing
import os

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values
from prometheus_client.multiprocess import MultiProcessCollector

from gateway import multiprocess_values
from gateway.multiprocess_values import FlushedFirst
from gateway.server import use_multiprocess_metrics

FORK = multiprocessing.get_context("fork")


@pytest.fixture
def batched(tmp_path, monkeypatch):
    """This process's metrics batched into files in ``tmp_path`` for one test."""
    monkeypatch.setattr(values, "ValueClass", values.ValueClass)
    monkeypatch.setattr(multiprocess_values, "_active", None)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    return use_multiprocess_metrics(str(tmp_path))


def _scrape(directory) -> CollectorRegistry:
    scraped = CollectorRegistry()
    MultiProcessCollector(scraped, path=str(directory))
    return scraped


def test_an_update_reaches_the_file_at_the_flush(batched, tmp_path):
    counter = Counter("kvgate_batch_test", "x", ["pod"], registry=CollectorRegistry())
    counter.labels("a").inc()
    counter.labels("a").inc(2)
    counter.labels("b").inc(5)
    assert _scrape(tmp_path).get_sample_value("kvgate_batch_test_total", {"pod": "a"}) == 0.0
    assert counter.labels("a")._value.get() == 3.0  # the process's own value is current

    assert batched.flush() == 2  # each updated value written once
    scraped = _scrape(tmp_path)
    assert scraped.get_sample_value("kvgate_batch_test_total", {"pod": "a"}) == 3.0
    assert scraped.get_sample_value("kvgate_batch_test_total", {"pod": "b"}) == 5.0
    assert batched.flush() == 0  # nothing updated since


def test_histograms_and_live_gauges_keep_their_files_and_sums(batched, tmp_path):
    registry = CollectorRegistry()
    histogram = Histogram("kvgate_batch_seconds", "x", buckets=(0.1, 1.0), registry=registry)
    gauge = Gauge("kvgate_batch_live", "x", multiprocess_mode="livesum", registry=registry)
    for seconds in (0.05, 0.5, 0.5, 3.0):
        histogram.observe(seconds)
    gauge.inc(4)
    gauge.dec(1)
    batched.flush()

    pid = os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"gauge_livesum_{pid}.db", f"histogram_{pid}.db"]  # fmt: skip
    scraped = _scrape(tmp_path)
    assert scraped.get_sample_value("kvgate_batch_seconds_bucket", {"le": "0.1"}) == 1.0
    assert scraped.get_sample_value("kvgate_batch_seconds_bucket", {"le": "1.0"}) == 3.0
    assert scraped.get_sample_value("kvgate_batch_seconds_count") == 4.0
    assert scraped.get_sample_value("kvgate_batch_seconds_sum") == pytest.approx(4.05)
    assert scraped.get_sample_value("kvgate_batch_live") == 3.0


def test_a_scrape_through_flushed_first_sees_its_own_updates(batched, tmp_path):
    counter = Counter("kvgate_batch_scraped", "x", registry=CollectorRegistry())
    counter.inc(7)
    exposition = CollectorRegistry()
    exposition.register(
        FlushedFirst(MultiProcessCollector(None, path=str(tmp_path)), batched.flush)
    )
    assert exposition.get_sample_value("kvgate_batch_scraped_total") == 7.0


def test_the_flush_loop_writes_periodically_and_once_more_when_stopped(
    batched, tmp_path, monkeypatch
):
    monkeypatch.setattr(multiprocess_values, "FLUSH_EVERY_S", 0.01)
    counter = Counter("kvgate_batch_loop", "x", registry=CollectorRegistry())

    def written() -> float | None:
        return _scrape(tmp_path).get_sample_value("kvgate_batch_loop_total")

    async def scenario() -> tuple[float | None, float | None]:
        task = asyncio.create_task(batched.run())
        counter.inc()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if written() == 1.0:
                break
        periodic = written()
        counter.inc()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return periodic, written()

    assert asyncio.run(scenario()) == (1.0, 2.0)


def test_a_forked_worker_writes_its_own_file(batched, tmp_path):
    """The pid that names a worker's metrics file is read once, and again after a fork:
    parent and child each write their own file, from zero, and a scrape sums both."""
    counter = Counter("kvgate_fork_test", "x", registry=CollectorRegistry())
    counter.inc()

    def child_work() -> None:
        counter.inc(2)
        assert counter._value.get() == 2.0  # not the parent's 1 + 2
        batched.flush()

    child = FORK.Process(target=child_work)
    child.start()
    child.join(10)
    assert child.exitcode == 0
    batched.flush()

    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(f"counter_{pid}.db" for pid in (os.getpid(), child.pid))
    assert _scrape(tmp_path).get_sample_value("kvgate_fork_test_total") == 3.0
