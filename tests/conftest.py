"""Fixtures every test module may ask for by name (pytest finds them here).

Redis fixtures run a real ``redis-server`` (``bench/redis_server.py``) on a free
loopback port; a test that asks for one is skipped, saying why, when the binary is
missing.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from bench.redis_server import REDIS_SERVER, SKIP_REASON, RedisServer, running_redis
from kvindex.redis_store import RedisStore


def _running_redis_or_skip() -> Iterator[RedisServer]:
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    with running_redis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session; tests keep apart by namespace."""
    yield from _running_redis_or_skip()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, for tests that kill, pause or restart it."""
    yield from _running_redis_or_skip()


@pytest.fixture
async def redis_store(redis_server: RedisServer) -> AsyncIterator[RedisStore]:
    """A ``RedisStore`` on the session's server, in a namespace no other test uses."""
    store = RedisStore(redis_server.url, namespace=f"t-{uuid.uuid4().hex[:8]}", key_ttl_s=60)
    yield store
    await store.close()
