"""``IndexStore`` in Redis, so many gateway replicas share one index.

Layout: one string per block key, named ``{kvgate:<namespace>}:b:<key as 16 hex>``,
holding short pod ids and tier bits (format in ``kvindex.redis_scripts``), plus
a small hash ``{kvgate:<namespace>}:pods`` mapping pod ids back to names (one
field per pod that wrote and was not dropped since; no TTL). Why one hash tag for
the whole namespace: a lookup is one MGET over thousands of block keys and a
write is one Lua script over hundreds, and Redis Cluster serves a multi-key
command only when all its keys share a slot. The price is that one namespace
(one model) lives on one shard; spread models over namespaces.

Lookups (``match``, ``l2_writers``) are ONE round trip: ``TIME`` and an ``MGET``
of every block key of the prompt, pipelined, with the request built as raw RESP
bytes (``_lookup_command``) because redis-py's asyncio packer costs ~1 µs per
argument. The prefix walk runs here over the reply (``redis_scripts.prefix_walk``)
instead of in Lua: Redis does only what it does in C (parse, look up, copy out),
and the walk touches each distinct value once. hiredis parses the reply (redis-py's
pure-Python parser would take ~5 ms for 2048 values). Pod ids are turned back into
names from a local cache filled by this replica's own writes; an id it has not
seen costs one ``HMGET`` of the registry, once.

Where a 2048-key lookup's time goes (2-core box, lightly loaded; ``INFO
commandstats``, ``/proc/<pid>/schedstat``, ``time.process_time``): the old Lua
walk took ~1.3 ms of Redis time; now MGET takes 0.26 ms (cache-warm) to 0.42 ms
(16k hot keys), of which ~0.1 ms is the per-key TTL check, and Redis spends
~0.13 ms more reading the ~90 KB request and writing the ~98 KB reply. The
client spends ~0.1 ms building the request, ~0.3 ms in redis-py/asyncio sending
it and parsing the reply, and ~0.08 ms in ``prefix_walk``.

Open: issue 3 asks for a 32k-token (2048-key) lookup p99 <= 1 ms on loopback; on a
shared 2-core box this layout gives p50 ~1.0-1.2 ms and p99 ~2.8-3.0 ms
(``kvgate bench index``). Reading every block key is the floor; the next steps are a
layout that reads fewer keys per lookup (e.g. per-chain checkpoint records written
with each stored run) and a leaner client than redis-py for this one command.

Why it stays flat in memory: every write of a block refreshes a TTL
(``key_ttl_s``, default 1 h), so blocks whose removal events were lost still go
away. Run Redis with ``maxmemory <bytes>`` and ``maxmemory-policy allkeys-lru``
as the hard bound; lookups read keys, so Redis's LRU keeps hot prefixes. Pick
``key_ttl_s`` above the time a block stays cached without being re-stored
(vLLM emits ``BlockStored`` once per residency); a block that outlives its TTL
simply stops attracting requests until it is stored again.

``stats().keys`` is ``DBSIZE`` (block keys plus one registry hash per
namespace): give the index its own Redis DB (``/1`` in the URL) or instance.
Per-pod counts are not tracked (that would cost a write per event);
``drop_pod`` and ``Cleared`` SCAN the namespace, which is fine for their rarity
(pod ejection, engine restart).

Errors (``redis.exceptions.RedisError``, ``OSError``) propagate: wrap the store
in ``ResilientStore`` for fallback. Socket timeouts default to 100 ms and a
command that lost its connection is retried once (a stale pooled connection
after a restart); a timeout is not retried.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from kvindex.redis_scripts import APPLY, prefix_walk
from kvindex.store import Cleared, IndexOp, IndexStats, Removed, Stored
from kvindex.types import PodPrefix, PrefixMatch, Tier

_MAX_KEY = 1 << 64
_KEYS_PER_CALL = 256  # bounds how long one apply script blocks lookups (~1 ms)
_POD_ID_CACHE = 4096
_TIER_MASK = {Tier.L0: 1, Tier.L1: 2, Tier.L2: 4}


class RedisStore:
    """Shared index in Redis; see the module docstring for layout and sizing."""

    backend = "redis"

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "kvgate",
        key_ttl_s: float = 3600.0,
        max_keys: int = 0,
        socket_timeout: float = 0.1,
        socket_connect_timeout: float = 0.1,
        retries: int = 1,
        **redis_kwargs: Any,
    ) -> None:
        """``url``: redis:// or rediss:// (TLS); password and TLS options
        (``password``, ``ssl_ca_certs``, ``ssl_certfile`` …) go in the URL or
        ``redis_kwargs``. ``max_keys`` is the capacity reported by ``stats`` (set
        it to what ``maxmemory`` holds); it bounds nothing by itself."""
        if any(c in namespace for c in "{}"):
            raise ValueError("namespace must not contain braces (it becomes the hash tag)")
        self.namespace = namespace
        self.key_ttl_ms = max(1, int(key_ttl_s * 1000))
        self.capacity = max_keys
        self.prefix = f"{{kvgate:{namespace}}}:b:"
        self.name_len = len(self.prefix.encode()) + 16
        self.registry = f"{{kvgate:{namespace}}}:pods"  # pod id -> pod name
        self._pod_ids: dict[str, str] = {}  # pod name -> id
        self._pod_names: dict[str, str] = {}  # id -> name, for names this replica registered
        # RESP framing of a lookup, TIME then one MGET (see _lookup_command): every
        # name is `$<len>` CRLF prefix hex CRLF, so names are joined by one separator
        self._mget_sep = f"\r\n${self.name_len}\r\n{self.prefix}".encode()
        self.bad_keys = 0  # keys outside [0, 2^64), counted and skipped
        self.bad_ops = 0  # ops of an unknown type
        self._redis: Redis = Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
            # retry only a dropped connection (stale pool after a restart), never a
            # timeout: a stalled Redis should cost one socket_timeout, not two
            retry=Retry(NoBackoff(), retries, supported_errors=(RedisConnectionError,)),
            **redis_kwargs,
        )
        self._apply = self._redis.register_script(APPLY)

    @property
    def client(self) -> Redis:
        return self._redis

    def key_name(self, key: int) -> str:
        return f"{self.prefix}{key:016x}"

    def pod_id(self, pod: str) -> str:
        """8 url-safe base64 chars (48 bits) of BLAKE2b(pod): the pod as stored in values."""
        pid = self._pod_ids.get(pod)
        if pid is None:
            if len(self._pod_ids) >= _POD_ID_CACHE:
                self._pod_ids.clear()
            digest = hashlib.blake2b(pod.encode(), digest_size=6).digest()
            pid = self._pod_ids[pod] = base64.urlsafe_b64encode(digest).decode()
        return pid

    def _pack(self, keys: Sequence[int]) -> bytes:
        """Keys as big-endian u64s (bad keys counted and skipped), at C speed."""
        try:
            return struct.pack(f">{len(keys)}Q", *keys)
        except struct.error:
            good = [k for k in keys if isinstance(k, int) and 0 <= k < _MAX_KEY]
            self.bad_keys += len(keys) - len(good)
            return struct.pack(f">{len(good)}Q", *good)

    def _names(self, keys: Sequence[int]) -> bytes:
        """Block key names concatenated (all ``name_len`` bytes), built at C speed."""
        packed = self._pack(keys)
        if not packed:
            return b""
        return (self.prefix + packed.hex(":", 8).replace(":", self.prefix)).encode()

    # -- reads ----------------------------------------------------------------

    async def _walk(self, keys: Sequence[int]) -> tuple[int, dict[str, PodPrefix], dict[str, int]]:
        """One round trip (TIME + MGET), then the walk in ``prefix_walk``; ids -> names."""
        command = self._lookup_command(keys)
        if command is None:
            return 0, {}, {}
        time_reply, values = await self._roundtrip(command, 2)
        now_ms = int(time_reply[0]) * 1000 + int(time_reply[1]) // 1000
        walk = prefix_walk(values, now_ms)
        names = await self._names_of([*walk.pods, *walk.writers])
        pods = {names[p]: PodPrefix(l0=a, l0_l1=b) for p, (a, b) in walk.pods.items()}
        return walk.l2, pods, {names[w]: n for w, n in walk.writers.items()}

    def _lookup_command(self, keys: Sequence[int]) -> bytes | None:
        """``TIME`` and ``MGET <every block key name>`` as one RESP buffer, built in C.

        redis-py's asyncio packer is pure Python (~1 µs per argument, so ~2 ms for
        2048 names); here the hex of all keys is split by one ``bytes.replace``."""
        packed = self._pack(keys)
        if not packed:
            return None
        n = len(packed) // 8
        head = b"*1\r\n$4\r\nTIME\r\n*%d\r\n$4\r\nMGET" % (n + 1)
        body = packed.hex(":", 8).encode().replace(b":", self._mget_sep)
        return b"".join((head, self._mget_sep, body, b"\r\n"))

    async def _roundtrip(self, command: bytes, replies: int) -> list[Any]:
        """Send pre-packed commands on a pooled connection and read ``replies`` replies.

        Same failure rules as redis-py's own commands: a dropped connection is
        retried (``retries`` times), a timeout is not. Any failure while replies
        are outstanding closes the connection, so a half-read pipeline is never
        handed to the next caller (that includes a caller cancelled mid-read)."""
        pool = self._redis.connection_pool
        conn = await pool.get_connection()
        try:
            return await conn.retry.call_with_retry(
                lambda: _exchange(conn, command, replies), lambda _error: conn.disconnect()
            )
        finally:
            await pool.release(conn)

    async def _names_of(self, ids: list[str]) -> dict[str, str]:
        """Pod id -> name; ids this replica has not registered are read from the registry
        (one ``HMGET``, only the first time a replica meets a pod). Unknown ids stay raw."""
        missing = [i for i in ids if i not in self._pod_names]
        if missing:
            found = await self._redis.hmget(self.registry, missing)
            for pid, name in zip(missing, found, strict=True):
                if name is not None:
                    self._remember(pid, name.decode())
        return {i: self._pod_names.get(i, i) for i in ids}

    def _remember(self, pid: str, name: str) -> None:
        if len(self._pod_names) >= _POD_ID_CACHE:
            self._pod_names.clear()
        self._pod_names[pid] = name

    async def match(self, keys: Sequence[int], block_size: int) -> PrefixMatch:
        """One round trip; the walk stops at the first key nobody holds."""
        l2, pods, _ = await self._walk(keys)
        return PrefixMatch(total_blocks=len(keys), block_size=block_size, pods=pods, l2=l2)

    async def l2_writers(self, keys: Sequence[int]) -> dict[str, int]:
        """Writer pod -> number of blocks it wrote within the fleet-wide L2 prefix."""
        return (await self._walk(keys))[2]

    async def stats(self) -> IndexStats:
        return IndexStats(
            backend=self.backend, keys=int(await self._redis.dbsize()), capacity=self.capacity
        )

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def server_id(self) -> str:
        """The Redis process's ``run_id``: it changes when Redis restarts (and lost data)."""
        return str((await self._redis.info("server"))["run_id"])

    # -- writes ---------------------------------------------------------------

    async def apply(self, pod: str, ops: Sequence[IndexOp]) -> None:
        """All of a batch's Stored/Removed in one pipelined round trip."""
        calls: list[list[Any]] = []
        for op in ops:
            if isinstance(op, Stored | Removed):
                code = ("S" if isinstance(op, Stored) else "R") + str(int(op.tier))
                calls += self._calls(code, pod, op.keys, 0)
            elif isinstance(op, Cleared):
                await self._run(calls)  # keep event order: earlier ops land first
                calls = []
                await self._clear(pod, sum(_TIER_MASK[t] for t in set(op.tiers)))
            else:
                self.bad_ops += 1
        await self._run(calls)

    async def speculate(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        """Mark ``pod`` as holding ``keys`` in L0 for ``ttl_s`` unless confirmed sooner.

        Deadlines use the Redis server clock, so all replicas agree on expiry."""
        await self._run(self._calls("P", pod, keys, max(1, int(ttl_s * 1000))))

    def _calls(self, code: str, pod: str, keys: Sequence[int], extra: int) -> list[list[Any]]:
        """APPLY script argument lists, ``_KEYS_PER_CALL`` keys each."""
        out = []
        pid = self.pod_id(pod)
        name = pod if code[0] in "SP" else ""  # writes (re)register the pod's name
        if name:
            self._remember(pid, name)
        for i in range(0, len(keys), _KEYS_PER_CALL):
            names = self._names(keys[i : i + _KEYS_PER_CALL])
            if names:
                args = [code, pid, self.key_ttl_ms, names, self.name_len, extra, name]
                out.append([*args, self.registry])
        return out

    async def _run(self, calls: list[list[Any]]) -> None:
        """EVALSHA each call in one pipeline; load the script once if Redis lost it.

        Not ``Script`` objects in the pipeline: redis-py then sends SCRIPT EXISTS
        before every batch, a second round trip. Re-running a batch is safe: every
        op is idempotent (set semantics)."""
        for attempt in (0, 1):
            if not calls:
                return
            pipe = self._redis.pipeline(transaction=False)
            for args in calls:
                pipe.evalsha(self._apply.sha, 1, args[3][: self.name_len], *args)
            try:
                await pipe.execute()
                return
            except NoScriptError:
                if attempt:
                    raise
                self._apply.sha = await self._redis.script_load(APPLY)

    async def drop_pod(self, pod: str) -> None:
        """Forget an ejected pod's L0/L1 entries; its L2 writes stay (shared storage).

        Its registry name goes too (so the registry holds live pods only); its L2
        writes are then attributed to its raw id until it writes again."""
        await self._clear(pod, _TIER_MASK[Tier.L0] | _TIER_MASK[Tier.L1])
        pid = self.pod_id(pod)
        self._pod_names.pop(pid, None)
        await self._redis.hdel(self.registry, pid)

    async def _clear(self, pod: str, mask: int) -> None:
        """SCAN the namespace and clear ``pod``'s tiers in ``mask`` batch by batch."""
        pattern = _glob_escape(self.prefix) + "*"
        pid = self.pod_id(pod)
        cursor = 0
        while True:
            cursor, found = await self._redis.scan(cursor, match=pattern, count=2000)
            names = b"".join(n for n in found if len(n) == self.name_len)
            if names:
                args = ["C", pid, self.key_ttl_ms, names, self.name_len, mask, ""]
                await self._run([[*args, self.registry]])
            if cursor == 0:
                return

    async def close(self) -> None:
        await self._redis.aclose()


async def _exchange(conn: AbstractConnection, command: bytes, replies: int) -> list[Any]:
    await conn.send_packed_command(command)
    try:
        return [await conn.read_response() for _ in range(replies)]
    except BaseException:
        await conn.disconnect(nowait=True)  # replies may be left unread
        raise


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
