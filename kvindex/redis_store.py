"""``IndexStore`` in Redis, so many gateway replicas share one index.

Layout, all under one hash tag ``{kvgate:<namespace>}``:

* ``:b:<key as 16 hex>``, one string per block key: short pod ids and tier bits
  (format in ``kvindex.redis_scripts``). The truth: every op updates these.
* ``:s:<key>``, one string per 16-block *group* of a chain, named by the group's
  last block: the values of the group's 16 blocks, run-length encoded (a group
  held alike throughout is one run), behind the summary epoch ``:epoch``. Chains
  are cut into groups from the root, so block ``d`` belongs to group ``d // 16``;
  ops say where each key sits (``kvindex.store.Positions``, from the event
  translator's chain map).
* ``:g:<first key of a group>``, a hash: the group's structure (each member's
  parent, and which summaries include it), so that a write to any block rewrites
  exactly the summaries that include it: a summary is always its blocks' values.
* ``:pods``, a small hash mapping pod ids back to names (one field per pod that
  wrote and was not dropped since; no TTL).

Why one hash tag for the whole namespace: a lookup is an MGET over many keys and a
write is one Lua script over hundreds, and Redis Cluster serves a multi-key
command only when all its keys share a slot. The price is that one namespace (one
model) lives on one shard; spread models over namespaces.

Lookups (``match``, ``l2_writers``) read summaries instead of blocks: ``TIME``
and one ``MGET`` of the epoch, the summaries of groups 1.. and the blocks of
group 0 and of the last partial group (145 keys for a 32k-token prompt instead
of 2048), pipelined. The walk (``redis_scripts.prefix_walk``) runs here over
those values, each run standing for its blocks. A group without a summary is one
the prompt's own chain was never stored through (it leaves what is cached inside
that group, the usual case for a cached prefix followed by new tokens): if a
chain reaches its start, its 16 blocks are read in a second round trip. Ops
without positions (a resync from the local view, tests) make no summaries:
lookups stay exact by reading blocks (after two such rounds, every remaining
block at once), only slower. A removal without positions bumps the epoch, which
retires every summary until rewritten. Requests are raw RESP built in C
(``_resp_names``: redis-py's asyncio packer costs ~1 µs per argument); hiredis
parses replies. Pod ids are turned back into names from a local cache filled by
this replica's own writes; an id it has not seen costs one ``HMGET`` of the
registry, then again at most every 10 s while the registry does not know it.

Why not one Lua script for the whole lookup (one round trip always): measured, a
script costs Redis ~45 µs just to take a 32 KB argument (Redis hashes every Lua
string in full) and 110-200 µs in all for 2048 keys, against ~20 µs for the
summaries' MGET and 100-200 µs for a loopback round trip on this VM. Redis is
the shared resource; the walk runs in the gateway replicas, which scale out.

What this costs, lookups against reading every block key and writes against
lookups, is measured by ``kvgate bench index`` (numbers in docs/performance.md):
summaries make a 32k-token lookup about three times cheaper and writes about half
as fast, and cost ~90 more bytes per block in Redis.

Why it stays flat in memory: every write of a block refreshes a TTL
(``key_ttl_s``, default 1 h), so blocks whose removal events were lost still go
away. Run Redis with ``maxmemory <bytes>`` and ``maxmemory-policy allkeys-lru``
as the hard bound; lookups read keys, so Redis's LRU keeps hot prefixes. Pick
``key_ttl_s`` above the time a block stays cached without being re-stored
(vLLM emits ``BlockStored`` once per residency); a block that outlives its TTL
simply stops attracting requests until it is stored again.

``stats().keys`` is ``DBSIZE`` (block keys, summaries, group hashes and one
registry hash per namespace): give the index its own Redis DB (``/1`` in the URL)
or instance. Summaries expire with the first of their blocks; group hashes live
``key_ttl_s`` after their last write. If ``maxmemory`` makes Redis evict keys,
the index loses entries (lookups then understate holdings) and a summary whose
group hash or blocks were evicted first can overstate them until it expires:
size ``maxmemory`` so that TTLs, not eviction, keep the index flat.
Per-pod counts are not tracked (that would cost a write per event);
``drop_pod`` and ``Cleared`` SCAN the namespace, which is fine for their rarity
(pod ejection, engine restart).

Redis Cluster (``cluster=True``): the whole namespace is one hash slot, so the store
talks to that slot's master with a plain client, found with ``CLUSTER SLOTS`` from
the URL's node (then from every node it has learnt, so the seed may die too). A
connection error, a timeout or a cluster redirection (``MOVED``, ``CLUSTERDOWN``,
``READONLY`` …) propagates as usual and makes the next call look the master up
again: after a failover ``ResilientStore`` serves the local view until the promoted
replica answers, sees a new ``server_id`` (its ``run_id``) and pushes its snapshot.
``stats().keys`` is then the slot's key count (``CLUSTER COUNTKEYSINSLOT``).

Errors (``redis.exceptions.RedisError``, ``OSError``) propagate: wrap the store
in ``ResilientStore`` for fallback. Socket timeouts default to 100 ms and a
command that lost its connection is retried once (a stale pooled connection
after a restart); a timeout is not retried.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from kvindex.redis_cluster import REROUTE_ON, SlotMaster
from kvindex.redis_scripts import APPLY, ApplyArgs, Walk, prefix_walk
from kvindex.store import (
    GROUP_BLOCKS,
    Cleared,
    IndexOp,
    IndexStats,
    Positions,
    Removed,
    Stored,
    chain_positions,
)
from kvindex.types import PodPrefix, PrefixMatch, Tier

_MAX_KEY = 1 << 64
_KEYS_PER_CALL = 256  # bounds how long one apply script blocks lookups (~1 ms)
_POD_ID_CACHE = 4096
_UNKNOWN_ID_RETRY_S = 10.0
_TIER_MASK = {Tier.L0: 1, Tier.L1: 2, Tier.L2: 4}
_REFINE_ROUNDS = 2  # after these, read every remaining block (the exact fallback)
_HEX = "0123456789abcdef"
_MAX_RUN_DIGITS = 2  # a summary run counts 1..16 blocks
T = TypeVar("T")


def _on_namespace_node(
    method: Callable[..., Awaitable[T]],
) -> Callable[..., Awaitable[T]]:
    """Run ``method`` on the node holding the namespace: in a cluster, find the slot's
    master first if it is not known, and forget it after an error that says it moved."""

    @functools.wraps(method)
    async def routed(self: RedisStore, *args: Any, **kwargs: Any) -> T:
        if not self._routed:
            await self._route()
        try:
            return await method(self, *args, **kwargs)
        except REROUTE_ON:
            if self.cluster:
                self._routed = False
            raise

    return routed


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
        cluster: bool = False,
        **redis_kwargs: Any,
    ) -> None:
        """``url``: redis:// or rediss:// (TLS); password and TLS options
        (``password``, ``ssl_ca_certs``, ``ssl_certfile`` …) go in the URL or
        ``redis_kwargs``. ``max_keys`` is the capacity reported by ``stats`` (set
        it to what ``maxmemory`` holds); it bounds nothing by itself. ``cluster``: the
        URL names one node of a Redis Cluster (see the module docstring)."""
        if any(c in namespace for c in "{}"):
            raise ValueError("namespace must not contain braces (it becomes the hash tag)")
        self.namespace = namespace
        self.key_ttl_ms = max(1, int(key_ttl_s * 1000))
        self.capacity = max_keys
        self.root = f"{{kvgate:{namespace}}}:"
        self.prefix = self.root + "b:"  # block keys
        self.summary_prefix = self.root + "s:"  # group summaries, same name length
        self.epoch_key = self.root + "epoch"
        self.name_len = len(self.prefix.encode()) + 16
        self.registry = self.root + "pods"  # pod id -> pod name
        self._pod_ids: dict[str, str] = {}  # pod name -> id
        self._pod_names: dict[str, str] = {}  # id -> name, for names this replica registered
        self._unknown_ids: dict[str, float] = {}  # id -> when to ask the registry again
        # RESP framing of lookups (see _resp_names): every name is `$<len>` CRLF
        # prefix hex CRLF, so one kind's names are joined by one separator
        self._block_sep = f"\r\n${self.name_len}\r\n{self.prefix}".encode()
        self._summary_sep = f"\r\n${self.name_len}\r\n{self.summary_prefix}".encode()
        self._epoch_arg = f"${len(self.epoch_key.encode())}\r\n{self.epoch_key}\r\n".encode()
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
        self.cluster = cluster
        self.slot = key_slot(self.root.encode())
        self._routed = not cluster  # a standalone server always holds the namespace
        self._master = SlotMaster(self._redis, self.slot)
        self._routing = asyncio.Lock()  # one lookup of the slot's master at a time

    @property
    def client(self) -> Redis:
        """The client of the node holding the namespace (as last known, in a cluster)."""
        return self._redis

    @_on_namespace_node
    async def on_namespace(self, call: Callable[[Redis], Awaitable[T]]) -> T:
        """``call`` with the client of the namespace's node (other data of this
        namespace's replicas, e.g. their published load, lives in the same slot)."""
        return await call(self._redis)

    @property
    def routed(self) -> bool:
        """Whether the node holding the namespace is known. False in a cluster until its
        slot's master is found, and again after an error that says it may have moved:
        the next call then looks it up first, asking known nodes one after another
        (a socket timeout each that hangs), so a caller that must answer fast (a
        lookup on a request's way) checks this and leaves that to another call."""
        return self._routed

    async def _route(self) -> None:
        """Point the client at the master of the namespace's slot (a cluster)."""
        async with self._routing:  # concurrent callers share one lookup
            if self._routed:
                return
            self._redis = await self._master.locate(self._redis)
            self._routed = True

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
        """Group summaries, then the blocks of groups without one that a chain reaches.

        Round 1 reads ``TIME``, the summary epoch, the summaries of full groups
        1.. and the blocks of group 0 and of the last, partial group. The walk
        runs over those values (a summary's runs stand for its blocks, exactly).
        A chain that reaches a group without a summary may end anywhere inside
        it: that group's 16 blocks are read (one more round trip) and the walk
        repeats. After ``_REFINE_ROUNDS`` such rounds every group still unknown
        is read at once."""
        packed = self._pack(keys)
        n = len(packed) // 8
        if not n:
            return 0, {}, {}
        full = n // GROUP_BLOCKS
        g0 = min(n, GROUP_BLOCKS)  # group 0's blocks are always read
        tail = max(1, full) * GROUP_BLOCKS  # first block of the last, partial group
        first = packed[: g0 * 8] + packed[tail * 8 :]
        # the last key of groups 1 .. full-1, every 16th 8-byte key from the 32nd
        ends = memoryview(packed).cast("Q")[2 * GROUP_BLOCKS - 1 :: GROUP_BLOCKS].tobytes()
        head = b"*1\r\n$4\r\nTIME\r\n*%d\r\n$4\r\nMGET\r\n" % (2 + (len(ends) + len(first)) // 8)
        command = b"".join(
            (head, self._epoch_arg, self._resp_names(self._summary_sep, ends),
             self._resp_names(self._block_sep, first))
        )  # fmt: skip
        time_reply, reply = await self._roundtrip(command, 2)
        now_ms = int(time_reply[0]) * 1000 + int(time_reply[1]) // 1000
        epoch = (reply[0] or b"0") + b"#"
        # runs[g]: group g's block values as (values, sizes), from its summary
        # (None: absent or stale: its blocks may have to be read)
        parsed: dict[bytes | None, tuple[list[bytes | None], list[int]] | None] = {None: None}
        runs = [None] * full
        for g, v in enumerate(reply[1:full], 1):
            got = parsed.get(v, False)
            if got is False:
                got = parsed[v] = _runs(v, epoch)
            runs[g] = got
        blocks = reply[max(1, full) :]
        head_values, tail_values = blocks[:g0], blocks[g0:]
        refined: dict[int, list[bytes | None]] = {}  # group -> its blocks' values
        extra = 0  # round trips after the first
        while True:
            values, sizes = list(head_values), [1] * g0
            for g in range(1, full):
                got = runs[g]
                if got is not None:
                    values += got[0]
                    sizes += got[1]
                elif g in refined:
                    values += refined[g]
                    sizes += [1] * GROUP_BLOCKS
                else:
                    values.append(None)  # unknown: the walk stops here, or reads it
                    sizes.append(GROUP_BLOCKS)
            values += tail_values
            sizes += [1] * len(tail_values)
            walk = prefix_walk(values, now_ms, sizes)
            pending = sorted(
                g
                for g in _ends_at_group_starts(walk)
                if 0 < g < full and runs[g] is None and g not in refined
            )
            if not pending:
                break
            extra += 1
            if extra > _REFINE_ROUNDS:  # read every unknown group left at once
                pending = [
                    g for g in range(pending[0], full) if runs[g] is None and g not in refined
                ]
            span = GROUP_BLOCKS * 8
            read = b"".join(packed[g * span : (g + 1) * span] for g in pending)
            command = b"*%d\r\n$4\r\nMGET\r\n" % (1 + len(read) // 8)
            command += self._resp_names(self._block_sep, read)
            (reply,) = await self._roundtrip(command, 1)
            for j, g in enumerate(pending):
                refined[g] = reply[j * GROUP_BLOCKS : (j + 1) * GROUP_BLOCKS]
        names = await self._names_of([*walk.pods, *walk.writers])
        pods = {names[p]: PodPrefix(l0=a, l0_l1=b) for p, (a, b) in walk.pods.items()}
        return walk.l2, pods, {names[w]: k for w, k in walk.writers.items()}

    @staticmethod
    def _resp_names(sep: bytes, packed: bytes) -> bytes:
        """RESP bulk strings of the names of ``packed`` keys, built in C: the hex of all
        keys is split by one ``bytes.replace`` (redis-py's packer costs ~1 µs each)."""
        if not packed:
            return b""
        return b"".join((sep[2:], packed.hex(":", 8).encode().replace(b":", sep), b"\r\n"))

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
        now = time.monotonic()
        unknown = self._unknown_ids
        missing = [i for i in ids if i not in self._pod_names and unknown.get(i, 0.0) <= now]
        if missing:
            found = await self._redis.hmget(self.registry, missing)
            for pid, name in zip(missing, found, strict=True):
                text = _utf8_or_none(name)
                if text is not None:
                    self._remember(pid, text)
                    unknown.pop(pid, None)
                else:  # a dropped pod's L2 writes (or a corrupt name): ask again later,
                    # not on every lookup; meanwhile the raw id stands for the pod
                    if len(unknown) >= _POD_ID_CACHE:
                        unknown.clear()
                    unknown[pid] = now + _UNKNOWN_ID_RETRY_S
        return {i: self._pod_names.get(i, i) for i in ids}

    def _remember(self, pid: str, name: str) -> None:
        if len(self._pod_names) >= _POD_ID_CACHE:
            self._pod_names.clear()
        self._pod_names[pid] = name

    @_on_namespace_node
    async def match(self, keys: Sequence[int], block_size: int) -> PrefixMatch:
        """One round trip (two when a chain ends in a group without a summary)."""
        l2, pods, _ = await self._walk(keys)
        return PrefixMatch(total_blocks=len(keys), block_size=block_size, pods=pods, l2=l2)

    @_on_namespace_node
    async def l2_writers(self, keys: Sequence[int]) -> dict[str, int]:
        """Writer pod -> number of blocks it wrote within the fleet-wide L2 prefix."""
        return (await self._walk(keys))[2]

    @_on_namespace_node
    async def stats(self) -> IndexStats:
        if self.cluster:  # a node holds other slots too: count the namespace's own
            keys = await self._redis.execute_command("CLUSTER COUNTKEYSINSLOT", self.slot)
        else:
            keys = await self._redis.dbsize()
        return IndexStats(backend=self.backend, keys=int(keys), capacity=self.capacity)

    @_on_namespace_node
    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    @_on_namespace_node
    async def server_id(self) -> str:
        """The Redis process's ``run_id``: it changes when Redis restarts (and lost data)."""
        return str((await self._redis.info("server"))["run_id"])

    # -- writes ---------------------------------------------------------------

    @_on_namespace_node
    async def apply(self, pod: str, ops: Sequence[IndexOp]) -> None:
        """All of a batch's Stored/Removed in one pipelined round trip."""
        calls: list[ApplyArgs] = []
        for op in ops:
            if isinstance(op, Stored | Removed):
                code = ("S" if isinstance(op, Stored) else "R") + str(int(op.tier))
                calls += self._calls(code, pod, op.keys, 0, op.pos)
            elif isinstance(op, Cleared):
                await self._run(calls)  # keep event order: earlier ops land first
                calls = []
                await self._clear(pod, sum(_TIER_MASK[t] for t in set(op.tiers)))
            else:
                self.bad_ops += 1
        await self._run(calls)

    @_on_namespace_node
    async def speculate(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        """Mark ``pod`` as holding ``keys`` in L0 for ``ttl_s`` unless confirmed sooner.

        Deadlines use the Redis server clock, so all replicas agree on expiry."""
        ttl_ms = max(1, int(ttl_s * 1000))
        await self._run(self._calls("P", pod, keys, ttl_ms, chain_positions(keys)))

    def speculate_nowait(
        self, pod: str, keys: Sequence[int], ttl_s: float
    ) -> Coroutine[Any, Any, None]:
        """Nothing is local here: the whole write is the returned coroutine."""
        return self.speculate(pod, keys, ttl_s)

    def l0_blocks_now(self, pod: str) -> int | None:
        """Not kept in Redis (a count per pod would be one more write per event);
        ``ResilientStore`` answers from its local view."""
        return None

    def _calls(
        self, code: str, pod: str, keys: Sequence[int], extra: int, pos: Positions | None = None
    ) -> list[ApplyArgs]:
        """APPLY script calls, ``_KEYS_PER_CALL`` keys each."""
        out = []
        pid = self.pod_id(pod)
        name = pod if code[0] in "SP" else ""  # writes (re)register the pod's name
        if name:
            self._remember(pid, name)
        if pos is not None and len(pos) != len(keys):
            pos = None
        for i in range(0, len(keys), _KEYS_PER_CALL):
            j = i + _KEYS_PER_CALL
            chunk = keys[i:j]
            names = self._names(chunk)
            if not names:
                continue
            offsets = anchors = parents = ""
            if pos is not None and len(names) == len(chunk) * self.name_len:
                try:
                    anchors = struct.pack(f">{len(chunk)}Q", *pos.anchors[i:j]).hex()
                    parents = struct.pack(f">{len(chunk)}Q", *pos.parents[i:j]).hex()
                    offsets = "".join(_HEX[o % GROUP_BLOCKS] for o in pos.offsets[i:j])
                except struct.error:  # positions we cannot encode: write without them
                    offsets = anchors = parents = ""
            call = self._apply_args(
                code, pid, names, extra=extra, pod_name=name,
                offsets=offsets, anchors=anchors, parents=parents,
            )  # fmt: skip
            out.append(call)
        return out

    def _apply_args(
        self, op: str, pod_id: str, names: bytes, *, extra: int, pod_name: str = "",
        offsets: str = "", anchors: str = "", parents: str = "",
    ) -> ApplyArgs:  # fmt: skip
        """One call's arguments; the rest (TTL, name length, registry, root) are this store's."""
        return ApplyArgs(
            op=op, pod_id=pod_id, key_ttl_ms=self.key_ttl_ms, names=names, name_len=self.name_len,
            extra=extra, pod_name=pod_name, registry=self.registry, offsets=offsets,
            anchors=anchors, parents=parents, root=self.root,
        )  # fmt: skip

    async def _run(self, calls: list[ApplyArgs]) -> None:
        """EVALSHA each call in one pipeline; load the script once if Redis lost it.

        Not ``Script`` objects in the pipeline: redis-py then sends SCRIPT EXISTS
        before every batch, a second round trip. Re-running a batch is safe: every
        op is idempotent (set semantics)."""
        for attempt in (0, 1):
            if not calls:
                return
            pipe = self._redis.pipeline(transaction=False)
            for call in calls:
                pipe.evalsha(self._apply.sha, 1, call.first_name, *call.argv())
            try:
                await pipe.execute()
                return
            except NoScriptError:
                if attempt:
                    raise
                self._apply.sha = await self._redis.script_load(APPLY)

    @_on_namespace_node
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
        pattern = _glob_escape(self.root) + "[bs]:*"  # blocks and group summaries
        pid = self.pod_id(pod)
        cursor = 0
        while True:
            cursor, found = await self._redis.scan(cursor, match=pattern, count=2000)
            names = b"".join(n for n in found if len(n) == self.name_len)
            if names:
                await self._run([self._apply_args("C", pid, names, extra=mask)])
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


def _runs(summary: bytes | None, epoch: bytes) -> tuple[list[bytes | None], list[int]] | None:
    """A summary's block values (``"<n>*<value>/..."`` after the epoch) as (values,
    sizes) for ``prefix_walk``; None if it is absent, from an older epoch, or does
    not describe exactly one group (then the group's blocks are read instead)."""
    if summary is None or not summary.startswith(epoch):
        return None
    values: list[bytes | None] = []
    sizes: list[int] = []
    for run in summary[len(epoch) :].split(b"/"):
        count, _, value = run.partition(b"*")
        # bytes.isdigit is ASCII only; the length cap keeps int() from refusing (over
        # 4300 digits) and costing time: a valid count is 1..16
        if not (0 < len(count) <= _MAX_RUN_DIGITS and count.isdigit()):
            return None
        values.append(value or None)
        sizes.append(int(count))
    return (values, sizes) if sum(sizes) == GROUP_BLOCKS else None


def _utf8_or_none(name: bytes | None) -> str | None:
    """A registry name as text; None if absent or not UTF-8 (not written by ``APPLY``)."""
    if name is None:
        return None
    try:
        return name.decode()
    except UnicodeDecodeError:
        return None


def _ends_at_group_starts(walk: Walk) -> set[int]:
    """Groups at whose first block some chain ends: if the group had no summary, the
    chain may end anywhere inside it, so its blocks must be read."""
    stops = {walk.l2, *(end for pair in walk.pods.values() for end in pair)}
    return {e // GROUP_BLOCKS for e in stops if e % GROUP_BLOCKS == 0}
