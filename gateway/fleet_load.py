"""Fleet-wide in-flight load: every replica's counts per pod, shared through Redis.

A replica counts only what it dispatched itself; with N replicas behind a Service
each sees about 1/N of every pod's load, so a cache-aware strategy piles onto the
pod holding a prefix N times over before it spills. With a Redis index every replica
(one process, or the worker 0 of a ``--workers`` host, speaking for all its workers)
keeps one field of the namespace's hash ``{kvgate:<ns>}:load``: its in-flight,
prefilling-token and prefilling counts per pod (busy pods only; an idle replica has no
field), behind a deadline ``load_lease_s`` ahead on the Redis server's clock. One
script call (an exchange) writes the field and returns every other replica's field
whose deadline has not passed (and deletes those long dead). A replica exchanges:

* at once when its own counts move (``PokingTracker``: a dispatch, a first token, an
  end), so the others read them within a round trip;
* when it routes a request and its copy of the others' counts is older than
  ``load_interval_s`` (``fresh``): the request awaits that exchange beside its index
  lookup, which is a Redis round trip too, so it routes on counts at most
  ``load_interval_s`` old, and usually a round trip old, without waiting for them;
* otherwise every ``load_lease_s / 4``, to keep its field's lease.

So the cost is a round trip per change of a replica's counts (one exchange at a
time: changes during one make one more), one per request that finds the counts
stale, and four a lease when nothing happens. A ``--workers`` host's worker 0 speaks
for workers whose dispatches do not poke it and whose requests cannot await its
exchange, so it exchanges every ``load_interval_s`` instead (``kvgate bench
shared-load`` measures both). A replica that dies stops counting within
``load_lease_s``; a Redis outage leaves each replica on its own counts once the last
answer is older than the lease. A Redis that stops answering holds the requests
waiting on an exchange for the store's socket timeout (100 ms) once; no request
waits for an exchange while they fail.

Routing adds these counts to its own (``routing.load.CombinedLoad``; with workers,
the host's shared table holds them), and the cost model subtracts the fleet's
in-flight requests from the pod's scraped ``vllm:num_requests_waiting``, so vLLM's
own queue gauges count only what no replica knows about.

Pods are named by ``host_load.pod_key`` (63 bits of xxh3): short fields, the same
key in every replica and in the host table.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import NoScriptError, RedisError

from gateway.host_load import pod_key
from gateway.logs import ThrottledError
from kvindex.redis_store import RedisStore
from routing.load import LoadCell, LoadTracker, PodLoad

log = logging.getLogger("kvgate.fleet_load")

# KEYS[1] the hash; ARGV: this replica's field, its counts ("" when idle), lease ms.
# Returns the other live replicas' [field, counts, ...].
EXCHANGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[3])
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], (now + lease) .. '|' .. ARGV[2])
  redis.call('PEXPIRE', KEYS[1], lease * 10)
end
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    local v = all[i + 1]
    local bar = string.find(v, '|', 1, true)
    local deadline = bar and tonumber(string.sub(v, 1, bar - 1)) or 0
    if deadline >= now then
      out[#out + 1] = all[i]
      out[#out + 1] = string.sub(v, bar + 1)
    elseif deadline + lease * 10 < now then
      redis.call('HDEL', KEYS[1], all[i])
    end
  end
end
return out
"""
_SHA = hashlib.sha1(EXCHANGE.encode()).hexdigest()
MAX_PODS_PER_REPLICA = 4096
# No pod has 2**31 requests or prompt tokens in flight; a larger count is another
# replica's bug or a hostile write. Clamped here, the sum over ``max_replicas`` of
# them still fits the host table's signed 64-bit words, and the cost model can turn it
# into a float (a count like 10**308 cannot be).
MAX_COUNT = 2**31 - 1
# ``pod_key`` values: 63 bits and never 0 (0 marks a free row of the host table).
_MAX_POD_KEY = 2**63 - 1


def encode_counts(loads: Mapping[int, PodLoad]) -> str:
    """``<key hex>:<in_flight>,<prefill_tokens>,<prefilling>;...`` of busy pods."""
    return ";".join(
        f"{key:x}:{v.in_flight},{v.prefill_tokens},{v.prefilling}"
        for key, v in loads.items()
        if not v.idle
    )


def _clamp_count(count: int) -> int:
    return min(max(0, count), MAX_COUNT)


def decode_counts(text: str, into: dict[int, PodLoad], max_pods: int) -> None:
    """Add one replica's counts into ``into``: malformed entries and keys no
    ``pod_key`` can be are skipped, counts clamped to ``0..MAX_COUNT``."""
    for n, entry in enumerate(text.split(";")):
        if n >= max_pods:
            return
        key, _, counts = entry.partition(":")
        try:
            a, b, c = (_clamp_count(int(x)) for x in counts.split(","))
            k = int(key, 16)
        except ValueError:
            continue
        if not 0 < k <= _MAX_POD_KEY:
            continue
        into[k] = into.get(k, PodLoad()).plus(PodLoad(a, b, c))


def decode_field(value: bytes | str) -> str:
    """A replica's field as text. Bytes that are not UTF-8 (no replica of ours writes
    them) become U+FFFD, so the entries holding them fail to parse and are skipped
    while the rest of the field still counts."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class _Poked:
    """A pod's counters that poke the exchange whenever they move."""

    __slots__ = ("_cell", "_poke")

    def __init__(self, cell: LoadCell, poke: Callable[[], None]) -> None:
        self._cell = cell
        self._poke = poke

    def add(self, in_flight: int, prefill_tokens: int, prefilling: int) -> None:
        self._cell.add(in_flight, prefill_tokens, prefilling)
        self._poke()


class PokingTracker(LoadTracker):
    """This replica's own counts; every dispatch, first token and end pokes the
    exchange, so the other replicas see it within a round trip, not an interval."""

    def __init__(self, poke: Callable[[], None]) -> None:
        super().__init__()
        self._poke = poke

    def cell(self, pod: str) -> LoadCell:
        return _Poked(super().cell(pod), self._poke)

    def keyed_counts(self) -> dict[int, PodLoad]:
        """These counts per ``pod_key``, as an exchange publishes them (its ``own``)."""
        return {pod_key(pod): load for pod, load in self.snapshot().items()}


class RemoteLoad:
    """The other replicas' counts as last heard: a ``routing.load.LoadSource``."""

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s
        self._loads: dict[int, PodLoad] = {}
        self._as_of = 0.0
        self._keys: dict[str, int] = {}  # pod -> pod_key, bounded below

    def update(self, loads: dict[int, PodLoad]) -> None:
        self._loads = loads
        self._as_of = time.monotonic()

    def others(self, pod: str) -> PodLoad | None:
        if not self._loads or time.monotonic() - self._as_of > self.max_age_s:
            return None
        key = self._keys.get(pod)
        if key is None:
            if len(self._keys) >= MAX_PODS_PER_REPLICA:
                self._keys.clear()
            key = self._keys[pod] = pod_key(pod)
        return self._loads.get(key)

    def __len__(self) -> int:
        return len(self._loads)


class FleetLoadMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.replicas = Gauge(
            "kvgate_fleet_load_replicas",
            "Other gateway replicas whose in-flight counts routing adds to its own",
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.errors = Counter(
            "kvgate_fleet_load_errors", "Failed exchanges of in-flight counts", registry=registry
        )
        self.exchange = Histogram(
            "kvgate_fleet_load_exchange_seconds",
            "One exchange of in-flight counts with Redis (publish ours, read the others')",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
            registry=registry,
        )


class FleetLoadExchange:
    """Publishes this replica's counts and reads the others': when its counts move,
    when a request finds the others' counts older than ``interval_s`` (``fresh``), and
    every ``idle_interval_s`` (default ``interval_s``) otherwise."""

    def __init__(
        self,
        redis: RedisStore,
        replica_id: str,
        own: Callable[[], Mapping[int, PodLoad]],
        sink: Callable[[dict[int, PodLoad]], None],
        *,
        interval_s: float = 0.05,
        idle_interval_s: float | None = None,
        lease_s: float = 1.0,
        max_replicas: int = 256,
        metrics: FleetLoadMetrics | None = None,
    ) -> None:
        self.redis = redis
        self.metrics = metrics
        self.key = redis.root + "load"
        self.replica_id = replica_id
        self._own = own
        self._sink = sink
        self.interval_s = interval_s
        self.idle_interval_s = interval_s if idle_interval_s is None else idle_interval_s
        self.lease_ms = max(1, int(lease_s * 1000))
        self.max_replicas = max_replicas
        self._task: asyncio.Task[None] | None = None
        self._poked = asyncio.Event()
        # Requests waiting for the exchange in flight (or the next) to end: ``fresh``.
        self._waiters: list[asyncio.Future[None]] = []
        self.exchanges = 0
        self.errors = 0
        self.replicas = 0  # other live replicas at the last exchange
        self.last_rtt_s = 0.0
        self._last_ok = 0.0
        self._read_at = float("-inf")  # when the last exchange that answered was sent
        self._failing = False  # the last exchange failed
        # Set by stop() beside its cancel: the loop must end even where a cancel is
        # lost (about one stop in 30 of kvgate bench shared-load's hung at the poke
        # wait, its task cancelling; where the cancel went is not known).
        self._stopping = False
        # A round runs every few milliseconds: a persistent bug must not flood the log.
        self._log_unexpected = ThrottledError(log, "fleet load exchange failed unexpectedly")

    async def exchange(self) -> dict[int, PodLoad]:
        """One round trip: publish ours, return the others' summed per pod."""
        counts = encode_counts(self._own())
        started = time.perf_counter()
        reply = await self.redis.on_namespace(lambda r: self._call(r, counts))
        self.last_rtt_s = time.perf_counter() - started
        others: dict[int, PodLoad] = {}
        fields = reply[1::2][: self.max_replicas]
        for value in fields:
            decode_counts(decode_field(value), others, MAX_PODS_PER_REPLICA)
        self.replicas = len(fields)
        self.exchanges += 1
        if self.metrics is not None:
            self.metrics.replicas.set(self.replicas)
            self.metrics.exchange.observe(self.last_rtt_s)
        return others

    async def _call(self, r: object, counts: str) -> list[bytes]:
        args = (self.key, self.replica_id, counts, self.lease_ms)
        try:
            return await r.evalsha(_SHA, 1, *args)  # type: ignore[attr-defined]
        except NoScriptError:
            await r.script_load(EXCHANGE)  # type: ignore[attr-defined]
            return await r.evalsha(_SHA, 1, *args)  # type: ignore[attr-defined]

    async def _run(self) -> None:
        while not self._stopping:
            # Cleared before the exchange, not after: counts that move while it is on
            # its way were read too late for it and must make one more at once.
            self._poked.clear()
            sent = time.monotonic()
            try:
                self._sink(await self.exchange())
                self._last_ok = time.monotonic()
                self._read_at, self._failing = sent, False
            except (TimeoutError, RedisError, OSError) as exc:
                self._round_failed()
                log.debug("fleet load exchange failed: %r", exc)
            except Exception as exc:
                # Anything else (a bug, a field no replica of ours wrote) must cost this
                # round only: a dead task would silently stop publishing our counts and
                # reading the others'. CancelledError is not an Exception, so stop()
                # still ends the task.
                self._round_failed()
                self._log_unexpected(exc)
            self._release_waiters()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.idle_interval_s):
                    await self._poked.wait()

    def _round_failed(self) -> None:
        self._failing = True
        self.errors += 1
        if self.metrics is not None:
            self.metrics.errors.inc()
        if time.monotonic() - self._last_ok > self.lease_ms / 1000:
            self._sink({})  # the others' counts are too old to route on

    def poke(self) -> None:
        """This replica's counts changed: exchange now rather than at the next interval
        (one exchange at a time; pokes meanwhile make one more)."""
        self._poked.set()

    def fresh(self) -> asyncio.Future[None] | None:
        """For a request about to be routed: None if the others' counts were read
        within ``interval_s`` (or exchanges are failing: a Redis outage must not hold
        requests, which then route on what is left), else a future that the end of the
        exchange in flight, or of one started now, resolves. Await it beside the index
        lookup; cancelling it (a client gone) leaves the exchange alone."""
        if self._task is None or self._failing:
            return None
        if time.monotonic() - self._read_at <= self.interval_s:
            return None
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._poked.set()
        return waiter

    def _release_waiters(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():  # a cancelled one's request has gone
                waiter.set_result(None)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvgate-fleet-load")

    async def stop(self) -> None:
        """Stop, and take this replica's field out (its requests end with it)."""
        if self._task is not None:
            self._stopping = True
            self._poked.set()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self._stopping = False
        self._release_waiters()
        with contextlib.suppress(RedisError, OSError, asyncio.TimeoutError):
            await self.redis.on_namespace(lambda r: r.hdel(self.key, self.replica_id))
