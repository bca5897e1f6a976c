"""Fixtures every test module may ask for by name (pytest finds them here).

Redis fixtures run a real ``redis-server`` (``bench/redis_server.py``) on a free
loopback port; a test that asks for one is skipped, saying why, when the binary is
missing. ``redis_cluster`` is a real Redis Cluster (3 masters, a replica each, made
with ``redis-cli --cluster create``); ``redis_target`` runs a test once on a single
server and once on that cluster, which is how the store's suite covers both.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from bench.redis_server import (
    CLUSTER_SKIP_REASON,
    REDIS_CLI,
    REDIS_SERVER,
    SKIP_REASON,
    RedisClusterServers,
    RedisServer,
    running_redis,
    running_redis_cluster,
)
from kvindex.redis_store import RedisStore


def _running_redis_or_skip() -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    with running_redis() as server:
        yield server


def _running_cluster_or_skip() -> Iterator[RedisClusterServers]:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(CLUSTER_SKIP_REASON)
    with running_redis_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session; tests keep apart by namespace."""
    yield from _running_redis_or_skip()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, for tests that kill, pause or restart it."""
    yield from _running_redis_or_skip()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """One Redis Cluster for the session (3 masters + 3 replicas); tests keep apart
    by namespace, and must not kill its nodes (``private_redis_cluster`` may)."""
    yield from _running_cluster_or_skip()


@pytest.fixture
def private_redis_cluster() -> Iterator[RedisClusterServers]:
    """A Redis Cluster of the test's own, for failovers."""
    yield from _running_cluster_or_skip()


@dataclass(frozen=True)
class RedisTarget:
    """Where a Redis test runs: a single server or a cluster (``cluster``)."""

    url: str
    cluster: bool

    def store(self, namespace: str | None = None, **kwargs: Any) -> RedisStore:
        namespace = namespace or f"t-{uuid.uuid4().hex[:8]}"
        # The store's 100 ms default suits a gateway that falls back fast; these
        # tests check what the store computes, and on a 2-core machine running the
        # whole suite a cluster node can take longer than that to accept a connect.
        # Tests of timeouts build their own store with the timeout they test.
        kwargs.setdefault("socket_timeout", 2.0)
        kwargs.setdefault("socket_connect_timeout", 2.0)
        return RedisStore(self.url, namespace=namespace, cluster=self.cluster, **kwargs)


@pytest.fixture(params=["standalone", "cluster"])
def redis_target(request: pytest.FixtureRequest) -> RedisTarget:
    """The session's redis-server, then the session's Redis Cluster."""
    if request.param == "cluster":
        return RedisTarget(request.getfixturevalue("redis_cluster").url, cluster=True)
    return RedisTarget(request.getfixturevalue("redis_server").url, cluster=False)


@pytest.fixture
async def redis_store(redis_target: RedisTarget) -> AsyncIterator[RedisStore]:
    """A ``RedisStore`` in a namespace no other test uses, on a server and on a cluster.

    On the cluster it has found its slot's master already, so ``store.client`` is
    that node's client."""
    store = redis_target.store(key_ttl_s=60)
    await store.ping()
    yield store
    await store.close()
