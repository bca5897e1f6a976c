"""What the worker processes of one host share: the load table and the message rings.

Both live in anonymous shared memory mapped before a fork; the tests fork real
processes (the supervisor's way) and check what the parent then sees.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest

from gateway.host_bus import HostBus
from gateway.host_load import HostLoadTable, pod_key
from gateway.workers import cgroup_cpu_limit, default_workers
from routing.load import PodLoad

FORK = multiprocessing.get_context("fork")


def _in_child(target, *args) -> None:
    proc = FORK.Process(target=target, args=args)
    proc.start()
    proc.join(10)
    assert proc.exitcode == 0


# -- the load table ---------------------------------------------------------------------


def _dispatch(table: HostLoadTable, worker: int, pod: str, n: int, prefill: int) -> None:
    view = table.view(worker)
    for _ in range(n):
        view.start(pod, prefill)  # never finished: still in flight when the child exits


def test_every_worker_reads_the_hosts_load_counted_in_another_process():
    table = HostLoadTable(workers=3, capacity=8)
    _in_child(_dispatch, table, 1, "pod-a", 2, 100)
    _in_child(_dispatch, table, 2, "pod-a", 1, 50)
    mine = table.view(0)
    r = mine.start("pod-a", 10)

    assert mine.get("pod-a") == PodLoad(4, 260, 4)
    r.first_token()
    assert mine.get("pod-a") == PodLoad(4, 250, 3)
    r.finish()
    assert mine.get("pod-a") == PodLoad(3, 250, 3)
    assert mine.get("pod-b") == PodLoad()


def test_a_dead_workers_column_is_zeroed_and_only_its_own():
    table = HostLoadTable(workers=2, capacity=8)
    _in_child(_dispatch, table, 1, "pod-a", 3, 30)
    table.view(0).start("pod-a", 5)

    table.clear_worker(1)

    assert table.view(0).get("pod-a") == PodLoad(1, 5, 1)


def test_the_other_replicas_load_counts_until_it_is_older_than_the_lease():
    table = HostLoadTable(workers=2, capacity=8)
    view = table.view(1, remote_max_age_s=60)
    table.set_remote({pod_key("pod-a"): PodLoad(5, 500, 2)})
    assert view.get("pod-a") == PodLoad(5, 500, 2)
    assert table.host_totals() == {}  # other replicas' counts are not ours to publish

    stale = table.view(1, remote_max_age_s=0.0)
    assert stale.get("pod-a") == PodLoad()
    table.set_remote({})
    assert view.get("pod-a") == PodLoad()


def test_a_full_table_reuses_an_idle_pods_row_and_counts_the_rest_locally():
    table = HostLoadTable(workers=1, capacity=2)
    view = table.view(0)
    busy = view.start("busy", 1)
    view.start("idle", 1).finish()

    view.start("new", 7)  # takes idle's row
    view.start("fourth", 9)  # no idle row left: counted in this worker only

    assert view.get("new") == PodLoad(1, 7, 1)
    assert view.get("fourth") == PodLoad(1, 9, 1)
    assert view.overflowed == 1
    assert view.get("idle") == PodLoad()
    assert set(table.host_totals()) == {pod_key("busy"), pod_key("new")}
    assert view.bound().size == 2 and view.bound().capacity == 2
    busy.finish()


# -- the message rings ------------------------------------------------------------------


def _publish(bus: HostBus, worker: int, messages: list[bytes]) -> None:
    end = bus.endpoint(worker)
    for m in messages:
        assert end.publish(7, m)


def test_messages_published_by_another_process_are_drained_in_order_once():
    bus = HostBus(workers=3, ring_bytes=4096)
    reader = bus.endpoint(0)
    got = []
    reader.on(7, lambda sender, payload: got.append((sender, payload)))

    _in_child(_publish, bus, 2, [b"one", b"two" * 100])
    _in_child(_publish, bus, 1, [b"three"])

    assert reader.drain() == 3
    # Each sender's messages in the order it published them (senders may interleave).
    assert [p for s, p in got if s == 2] == [b"one", b"two" * 100]
    assert [p for s, p in got if s == 1] == [b"three"]
    assert reader.drain() == 0


def test_records_wrap_around_the_ring_intact():
    bus = HostBus(workers=2, ring_bytes=4096)
    reader, writer = bus.endpoint(0), bus.endpoint(1)
    got = []
    reader.on(7, lambda s, p: got.append(p))
    sent = [bytes([i % 251]) * 1000 for i in range(12)]  # ~3 rings' worth, read as it goes
    for m in sent:
        writer.publish(7, m)
        reader.drain()

    assert got == sent


def test_a_reader_a_ring_behind_skips_and_counts_and_oversized_messages_are_refused():
    bus = HostBus(workers=2, ring_bytes=4096)
    reader, writer = bus.endpoint(0), bus.endpoint(1)
    for _ in range(6):
        writer.publish(7, b"x" * 1000)

    assert reader.drain() == 0
    assert reader.overruns == 1
    assert not writer.publish(7, b"y" * 3000)  # over half a ring
    assert writer.refused == 1
    writer.publish(7, b"after")
    got = []
    reader.on(7, lambda s, p: got.append(p))
    reader.drain()
    assert got == [b"after"]


def test_a_lock_left_held_by_a_dead_worker_is_released_by_the_supervisor():
    bus = HostBus(workers=2, ring_bytes=4096)
    table = HostLoadTable(workers=2, capacity=4)

    def die_holding() -> None:
        bus.locks[1].acquire()
        table.lock.acquire()
        os._exit(0)

    _in_child(die_holding)

    assert bus.repair_locks() == 1
    assert table.repair_lock()
    assert bus.endpoint(1).publish(7, b"ok")
    assert table.view(0).start("p").finished is False


# -- how many workers by default ----------------------------------------------------------


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
    ids=["v2-limit", "v2-unlimited", "v1-limit", "v1-unlimited", "no-cgroup"],
)
def test_a_cgroup_cpu_limit_is_read_from_v2_or_v1_files(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path) == limit


def test_the_default_is_one_worker_per_usable_core(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr("gateway.workers.cgroup_cpu_limit", lambda: 2.5)
    assert default_workers() == 3
    monkeypatch.setattr("gateway.workers.cgroup_cpu_limit", lambda: None)
    assert default_workers() == 8


def test_a_message_no_handler_can_take_is_counted_not_raised():
    bus = HostBus(workers=2, ring_bytes=4096)
    reader, writer = bus.endpoint(0), bus.endpoint(1)
    got = []
    reader.on(7, lambda s, p: got.append(int(p)))  # raises on a non-number
    writer.publish(7, b"not a number")
    writer.publish(9, b"a kind nobody handles")
    writer.publish(7, b"42")

    assert reader.drain() == 3
    assert (got, reader.bad) == ([42], 2)
