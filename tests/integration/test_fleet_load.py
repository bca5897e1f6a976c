"""Replicas' in-flight counts shared through Redis: each sees the others', not its own,
and a replica that stops publishing stops counting once its lease ends. Run on a
single server and on a Redis Cluster (``redis_target``)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from gateway.fleet_load import (
    FleetLoadExchange,
    PokingTracker,
    RemoteLoad,
    decode_counts,
    encode_counts,
)
from gateway.host_load import pod_key
from routing.load import CombinedLoad, LoadTracker, PodLoad
from tests.conftest import RedisTarget

pytestmark = pytest.mark.redis
A, B = pod_key("pod-a"), pod_key("pod-b")


def test_counts_round_trip_busy_pods_only_and_add_up_over_replicas():
    text = encode_counts({A: PodLoad(2, 300, 1), B: PodLoad()})
    assert text == f"{A:x}:2,300,1"
    total: dict[int, PodLoad] = {}
    decode_counts(text, total, 10)
    decode_counts(f"{A:x}:1,0,0;junk;{B:x}:x,1,2", total, 10)
    assert total == {A: PodLoad(3, 300, 1)}


class _Replica:
    def __init__(self, target: RedisTarget, namespace: str, lease_s: float = 1.0) -> None:
        self.own: dict[int, PodLoad] = {}
        self.seen: dict[int, PodLoad] = {}
        self.exchange = FleetLoadExchange(
            target.store(namespace), uuid.uuid4().hex[:8], lambda: self.own,
            self.seen.update, interval_s=0.02, lease_s=lease_s,
        )  # fmt: skip

    async def close(self) -> None:
        await self.exchange.stop()
        await self.exchange.redis.close()


@pytest.fixture
async def replicas(redis_target: RedisTarget):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    made = [_Replica(redis_target, ns), _Replica(redis_target, ns), _Replica(redis_target, ns)]
    yield made
    for r in made:
        await r.close()


async def test_each_replica_reads_every_other_replicas_counts_summed_but_not_its_own(replicas):
    a, b, c = replicas
    a.own = {A: PodLoad(2, 300, 1)}
    b.own = {A: PodLoad(1, 0, 0), B: PodLoad(4, 40, 4)}
    await a.exchange.exchange()
    await b.exchange.exchange()

    assert await c.exchange.exchange() == {A: PodLoad(3, 300, 1), B: PodLoad(4, 40, 4)}
    assert await a.exchange.exchange() == {A: PodLoad(1, 0, 0), B: PodLoad(4, 40, 4)}
    assert a.exchange.replicas == 1  # c is idle: it keeps no field


async def test_an_idle_or_stopped_replica_counts_for_nothing(replicas):
    a, b, _ = replicas
    a.own = {A: PodLoad(2, 0, 0)}
    await a.exchange.exchange()
    assert await b.exchange.exchange() == {A: PodLoad(2, 0, 0)}

    a.own = {}
    await a.exchange.exchange()
    assert await b.exchange.exchange() == {}

    a.own = {A: PodLoad(2, 0, 0)}
    await a.exchange.exchange()
    await a.exchange.stop()  # a clean shutdown takes its field out
    assert await b.exchange.exchange() == {}


async def test_a_replica_that_died_stops_counting_when_its_lease_ends(redis_target: RedisTarget):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    dead, alive = _Replica(redis_target, ns, lease_s=0.2), _Replica(redis_target, ns)
    try:
        dead.own = {A: PodLoad(5, 0, 0)}
        await dead.exchange.exchange()  # then nothing more: it crashed
        assert await alive.exchange.exchange() == {A: PodLoad(5, 0, 0)}
        await asyncio.sleep(0.3)
        assert await alive.exchange.exchange() == {}
    finally:
        await alive.close()
        await dead.exchange.redis.close()


async def test_routing_adds_the_other_replicas_counts_within_a_few_intervals(replicas):
    a, b, _ = replicas
    tracker = LoadTracker()
    remote = RemoteLoad(max_age_s=1.0)
    b.exchange._sink = remote.update
    view = CombinedLoad(tracker, {"fleet": remote})
    await a.exchange.start()
    await b.exchange.start()
    try:
        a.own = {A: PodLoad(3, 0, 3)}
        for _ in range(100):
            if view.get("pod-a").in_flight == 3:
                break
            await asyncio.sleep(0.01)
        tracker.start("pod-a", 10)
        assert view.get("pod-a") == PodLoad(4, 10, 4)
    finally:
        await a.exchange.stop()
        await b.exchange.stop()


def test_remote_counts_older_than_the_lease_are_ignored():
    remote = RemoteLoad(max_age_s=0.0)
    remote.update({A: PodLoad(1, 1, 1)})
    assert remote.others("pod-a") is None
    fresh = RemoteLoad(max_age_s=60)
    fresh.update({A: PodLoad(1, 1, 1)})
    assert (fresh.others("pod-a"), fresh.others("pod-b")) == (PodLoad(1, 1, 1), None)


async def test_a_dispatch_reaches_the_other_replica_before_the_interval_ends(
    redis_target: RedisTarget,
):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    seen = RemoteLoad(max_age_s=60)
    a = FleetLoadExchange(redis_target.store(ns), "a", dict, lambda _: None, interval_s=30)
    tracker = PokingTracker(a.poke)
    a._own = lambda: {pod_key(p): v for p, v in tracker.snapshot().items()}
    b = FleetLoadExchange(redis_target.store(ns), "b", dict, seen.update, interval_s=0.02)
    await a.start()
    await b.start()
    try:
        await asyncio.sleep(0.1)  # a's first exchange is behind it: the next is 30 s away
        request = tracker.start("pod-a", 100)
        for _ in range(100):
            if seen.others("pod-a") == PodLoad(1, 100, 1):
                break
            await asyncio.sleep(0.01)
        assert seen.others("pod-a") == PodLoad(1, 100, 1)
        request.finish()
        for _ in range(100):
            if seen.others("pod-a") is None:
                break
            await asyncio.sleep(0.01)
        assert seen.others("pod-a") is None  # idle: a keeps no field
    finally:
        for ex in (a, b):
            await ex.stop()
            await ex.redis.close()
