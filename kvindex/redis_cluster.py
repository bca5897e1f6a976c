"""Following the master of one hash slot in a Redis Cluster.

``RedisStore`` keeps a whole namespace under one hash tag, so in a cluster all of it
lives in one slot, served by one master at a time. Rather than a cluster client
(which routes every command by key, and would need the store's pre-packed lookups
taken apart), the store talks to that master with a plain client and asks
``CLUSTER SLOTS`` where the slot is when it does not know or after an error that
says it moved (``REROUTE_ON``). Every node a reply names is remembered (bounded), so
the node in the URL may fail later without leaving the store unable to ask.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MasterDownError,
    MovedError,
    ReadOnlyError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

MAX_NODES = 64  # nodes remembered to find the slot's master again
# After these, the slot's master is looked up again: it may have moved (a failover).
REROUTE_ON = (
    RedisConnectionError, RedisTimeoutError, OSError, TimeoutError, MovedError, AskError,
    ClusterDownError, TryAgainError, ReadOnlyError, MasterDownError,
)  # fmt: skip


def client_like(client: Redis, host: str, port: int) -> Redis:
    """A client configured like ``client`` (credentials, TLS, timeouts, retries) for
    another node."""
    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "host": host, "port": port}
    return Redis.from_pool(ConnectionPool(connection_class=pool.connection_class, **kwargs))


def address(client: Redis) -> tuple[str, int]:
    kw = client.connection_pool.connection_kwargs
    return str(kw.get("host")), int(kw.get("port", 6379))


class SlotMaster:
    """Where one slot's master is; ``locate`` moves a client there."""

    def __init__(self, seed: Redis, slot: int) -> None:
        self.slot = slot
        self.nodes: list[tuple[str, int]] = [address(seed)]
        self.lookups = 0  # CLUSTER SLOTS answers used (the first, then one per move)

    async def locate(self, current: Redis) -> Redis:
        """A client of the slot's master: ``current`` if it is that node already (else
        ``current`` is closed). Raises ``ConnectionError`` if no known node answers."""
        error: BaseException | None = None
        for host, port in list(self.nodes):
            probe = client_like(current, host, port)
            try:
                slots = await probe.execute_command("CLUSTER SLOTS")
            except REROUTE_ON as exc:
                error = exc
                continue
            finally:
                await probe.aclose()
            owner = self.learn(slots)
            if owner is None:
                error = ClusterDownError(f"no master serves slot {self.slot}")
                continue
            self.lookups += 1
            if address(current) == owner:
                return current
            await current.aclose()
            return client_like(current, *owner)
        raise RedisConnectionError(f"no Redis Cluster node answered: {error!r}")

    def learn(self, slots: list[Any]) -> tuple[str, int] | None:
        """Remember every node of a ``CLUSTER SLOTS`` reply; return the slot's master."""
        owner = None
        for start, end, *nodes in slots:
            for node in nodes:
                addr = (_text(node[0]), int(node[1]))
                if addr not in self.nodes and len(self.nodes) < MAX_NODES:
                    self.nodes.append(addr)
            if int(start) <= self.slot <= int(end) and nodes:
                owner = (_text(nodes[0][0]), int(nodes[0][1]))
        return owner


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
