"""Replicas' in-flight counts shared through Redis: each sees the others', not its own,
and a replica that stops publishing stops counting once its lease ends. Run on a
single server and on a Redis Cluster (``redis_target``)."""

from __future__ import annotations

import asyncio
import math
import uuid

import pytest

from bench.polling import wait_for_async
from bench.ports import free_port
from gateway.fleet_load import (
    MAX_COUNT,
    FleetLoadExchange,
    PokingTracker,
    RemoteLoad,
    decode_counts,
    encode_counts,
)
from gateway.host_load import HostLoadTable, pod_key
from kvindex.redis_store import RedisStore
from routing.cost_model import CostModel
from routing.load import CombinedLoad, LoadTracker, PodLoad
from routing.types import PodView
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


def test_decoding_clamps_counts_and_skips_keys_no_pod_can_have():
    total: dict[int, PodLoad] = {}
    decode_counts(f"{A:x}:{10**308},{2**63},-5;0:1,1,1;{2**63:x}:1,1,1;-{B:x}:1,1,1", total, 10)
    assert total == {A: PodLoad(MAX_COUNT, MAX_COUNT, 0)}


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
    a._own = tracker.keyed_counts
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


async def test_a_hostile_field_neither_stops_the_exchange_nor_breaks_routing(
    redis_target: RedisTarget,
):
    """Fields this replica's code never writes: bytes that are not UTF-8, and counts
    too large for the host table's 64-bit words or for a float."""
    table = HostLoadTable(workers=1)  # a --workers host's sink
    remote = RemoteLoad(max_age_s=60)  # a single process's sink

    def sink(loads: dict[int, PodLoad]) -> None:
        table.set_remote(loads)
        remote.update(loads)

    ex = FleetLoadExchange(
        redis_target.store(f"t-{uuid.uuid4().hex[:8]}"), "us", dict, sink, interval_s=0.02
    )
    live = b"9999999999999|"  # a deadline far ahead on the Redis server's clock
    hostile = {
        b"\xff": live + f"{A:x}:".encode() + b"\xff,1,1",
        b"huge": live + f"{A:x}:{2**63},{10**308},1;{B:x}:1,2,1".encode(),
    }
    await ex.redis.on_namespace(lambda r: r.hset(ex.key, mapping=hostile))
    await ex.start()
    try:
        await wait_for_async(lambda: ex.exchanges >= 3, 2.0, "three exchanges", poll=0.01)
        assert ex._task is not None and not ex._task.done()
        row_a, row_b = table.find(A), table.find(B)
        assert row_a is not None and row_b is not None
        assert table.remote_load(row_a, 60) == PodLoad(MAX_COUNT, MAX_COUNT, 1)
        assert table.remote_load(row_b, 60) == PodLoad(1, 2, 1)

        load = CombinedLoad(LoadTracker(), {"fleet": remote}).get("pod-a")
        assert load == PodLoad(MAX_COUNT, MAX_COUNT, 1)
        pod = PodView("pod-a", in_flight=load.in_flight, prefilling=load.prefilling,
                      in_flight_prefill_tokens=load.prefill_tokens)  # fmt: skip
        assert math.isfinite(CostModel().predict_ttft_s(pod, 0, 0, 0, 100))
    finally:
        await ex.stop()
        await ex.redis.close()


async def test_an_unexpected_error_costs_one_round_not_the_task(redis_target: RedisTarget):
    rounds: list[dict[int, PodLoad]] = []

    def flaky_sink(loads: dict[int, PodLoad]) -> None:
        rounds.append(loads)
        if len(rounds) == 1:
            raise RuntimeError("a bug in the sink")

    ex = FleetLoadExchange(
        redis_target.store(f"t-{uuid.uuid4().hex[:8]}"), "us", dict, flaky_sink, interval_s=0.02
    )
    await ex.start()
    try:
        await wait_for_async(lambda: len(rounds) >= 3, 2.0, "three rounds", poll=0.01)
        assert ex.errors >= 1
        assert ex._task is not None and not ex._task.done()
    finally:
        await ex.stop()  # a cancel still stops it
        assert ex._task is None
        await ex.redis.close()


async def test_a_poke_during_an_exchange_makes_one_more_at_once(redis_target: RedisTarget):
    """Counts that move while an exchange is on its way (here: as its answer is taken)
    are published by the next one at once, not an interval (30 s) later."""
    ex: FleetLoadExchange

    def poke_on_first_answer(_: dict[int, PodLoad]) -> None:
        if ex.exchanges == 1:
            ex.poke()

    ex = FleetLoadExchange(redis_target.store(f"t-{uuid.uuid4().hex[:8]}"), "us", dict,
                           poke_on_first_answer, interval_s=30)  # fmt: skip
    await ex.start()
    try:
        await wait_for_async(lambda: ex.exchanges >= 2, 2.0, "two exchanges", poll=0.01)
        assert ex.exchanges == 2
    finally:
        await ex.stop()
        await ex.redis.close()


async def test_a_request_has_the_others_counts_read_when_its_copy_is_stale(
    redis_target: RedisTarget,
):
    """Between requests a replica exchanges only to keep its lease (every 30 s here);
    a request that finds its copy of the others' counts older than the interval gets
    a future that one exchange resolves, after which the copy holds what another
    replica published a moment before. A cancelled waiter (its client gone) costs the
    others nothing, and the next request routes on the copy as it is."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    a_own: dict[int, PodLoad] = {}
    seen = RemoteLoad(max_age_s=60)
    a = FleetLoadExchange(redis_target.store(ns), "a", lambda: a_own, lambda _: None,
                          interval_s=30)  # fmt: skip
    b = FleetLoadExchange(redis_target.store(ns), "b", dict, seen.update, interval_s=0.02,
                          idle_interval_s=30)  # fmt: skip
    await a.start()
    await b.start()
    try:
        await wait_for_async(lambda: a.exchanges and b.exchanges, 2.0, "first exchanges",
                             poll=0.01)  # fmt: skip
        a_own[A] = PodLoad(2, 64, 1)
        a.poke()
        await wait_for_async(lambda: a.exchanges >= 2, 2.0, "a publishes", poll=0.01)
        await asyncio.sleep(0.03)  # b's copy is now older than its interval
        assert seen.others("pod-a") is None  # b has not read since: its next round is 30 s away
        rounds = b.exchanges
        gone, waiting = b.fresh(), b.fresh()
        assert gone is not None and waiting is not None
        gone.cancel()
        await asyncio.wait_for(waiting, 2.0)
        assert seen.others("pod-a") == PodLoad(2, 64, 1)
        assert b.exchanges == rounds + 1  # both requests were served by one exchange
        assert b.fresh() is None  # read just now
    finally:
        for ex in (a, b):
            await ex.stop()
            await ex.redis.close()


async def test_no_request_waits_for_an_exchange_while_redis_does_not_answer():
    """Exchanges failing (nothing listens on the port): requests route on what they
    have, at once, instead of each waiting out a timeout."""
    store = RedisStore(f"redis://127.0.0.1:{free_port()}", namespace="t")
    ex = FleetLoadExchange(store, "us", dict, lambda _: None, interval_s=0.02,
                           idle_interval_s=30)  # fmt: skip
    assert ex.fresh() is None  # not started: nothing to wait for
    await ex.start()
    try:
        await wait_for_async(lambda: ex.errors >= 1, 2.0, "a failed exchange", poll=0.01)
        assert ex.fresh() is None
    finally:
        await ex.stop()
        await store.close()
