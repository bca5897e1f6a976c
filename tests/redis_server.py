"""The real ``redis-server`` fixture for tests (the process wrapper lives in bench/)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.redis_server import REDIS_SERVER, SKIP_REASON, RedisServer, free_port, running_redis

requires_redis = pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)

__all__ = ["REDIS_SERVER", "RedisServer", "free_port", "requires_redis", "running_redis"]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session; skips the test when the binary is missing."""
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    with running_redis() as server:
        yield server
