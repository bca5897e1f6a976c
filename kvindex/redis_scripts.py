"""The Redis value format: the Lua that writes it and the Python that reads it.

Value of one block key (a plain string, so a lookup reads thousands with one MGET)::

    <l2 writer pod id or empty>|<pod id>=<x>;<pod id>=<x>...

Pod ids are 8-character hashes of the pod name (``RedisStore.pod_id``); the
registry hash ``{kvgate:<ns>}:pods`` maps them back to names. Why not the names
themselves: real pod names are ~40 bytes, and value size is most of what a
lookup pays per key (a 2048-key walk measured +40% with such names).

``x = bits + 4 * spec_deadline_ms``: ``bits`` 1 = L0 (confirmed), 2 = L1;
``spec_deadline_ms`` (server clock, ``TIME``) > now means a speculative L0.

Writes are the ``APPLY`` script (one round trip per event batch, read-modify-
write of each value on the server). Keys travel as ONE argument: the block key
names concatenated, all of the same length ``len`` (``{kvgate:<ns>}:b:`` + 16
hex digits). redis-py packs arguments in pure Python (~0.7 µs each), so 256
separate KEYS would cost more than the script. Every name carries the same hash
tag, so they all live in the slot of ``KEYS[1]`` (the first name), which is what
Redis Cluster routes on; open-source Redis (standalone and Cluster) lets a
legacy EVAL script touch undeclared keys of its own slot.

Reads are NOT a script: ``RedisStore`` sends ``TIME`` and one ``MGET`` of every
block key (all keys declared, so any Cluster proxy accepts it) and walks the
reply here, in ``prefix_walk``. Why: measured on a 2-core box for 2048 keys, a
Lua walk spent ~0.55-0.8 ms of Redis time turning names into Lua strings, Lua
strings into command arguments and the MGET reply back into Lua strings, and
another ~0.5 ms parsing values, against 0.26-0.42 ms for the bare MGET. Redis is
the shared resource; the gateway replica, which scales out, does the walk with
C-level list operations. The price: a lookup whose first key misses still reads
every key (0.26-0.42 ms of Redis time for 2048 keys) where the script stopped
after 64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, islice
from operator import ne


@dataclass(frozen=True, slots=True)
class Walk:
    """A prefix walk over block values, in pod ids (``RedisStore`` names them)."""

    l2: int  # fleet-wide consecutive L2 prefix
    pods: dict[str, tuple[int, int]]  # pod id -> (L0 prefix, L0∪L1 prefix); holders of key 0
    writers: dict[str, int]  # L2 writer pod id -> blocks it wrote within the L2 prefix


def holders(value: bytes, now_ms: int) -> tuple[dict[str, int], str]:
    """Pod id -> live tier bits (1 L0, incl. unexpired speculation; 2 L1), and the L2 writer.

    An entry that does not parse (a value not written by ``APPLY``) is skipped."""
    writer, _, entries = value.decode(errors="replace").partition("|")
    seen: dict[str, int] = {}
    for entry in entries.split(";"):
        pod, _, digits = entry.rpartition("=")
        if not (pod and digits.isdigit()):
            continue
        x = int(digits)
        bits = x & 3
        if not bits & 1 and x >> 2 > now_ms:
            bits |= 1
        if bits:
            seen[pod] = bits
    return seen, writer


def prefix_walk(values: Sequence[bytes | None], now_ms: int) -> Walk:
    """Consecutive prefixes over ``values`` (MGET order; None = key absent), exactly.

    Consecutive blocks of one cached prompt nearly always hold the same bytes, so
    the walk visits *runs* of equal values: the run starts come from one C-level
    pass (``map(ne, …)``), and Python only decodes each distinct value once and
    updates the per-pod chains where the value changes. Cost: one pass in C per
    lookup plus a few µs per run. The walk stops at the first key nobody holds
    (absent, or only expired speculation and no L2 copy)."""
    n = len(values)
    if not n or values[0] is None:
        return Walk(0, {}, {})
    starts = [0, *compress(range(1, n), map(ne, values, islice(values, 1, None))), n]
    decoded: dict[bytes, tuple[dict[str, int], str]] = {}
    alive0: set[str] = set()  # pods whose L0 chain is unbroken
    alive01: set[str] = set()  # pods whose L0∪L1 chain is unbroken
    ends0: dict[str, int] = {}
    ends01: dict[str, int] = {}
    writers: dict[str, int] = {}
    l2, end = -1, n  # l2 < 0: the L2 chain is unbroken
    for r in range(len(starts) - 1):
        k = starts[r]
        v = values[k]
        if v is None:
            end = k
            break
        got = decoded.get(v)
        if got is None:
            got = decoded[v] = holders(v, now_ms)
        seen, writer = got
        if k == 0:
            alive01 = set(seen)
            alive0 = {p for p, bits in seen.items() if bits & 1}
            ends0 = dict.fromkeys(seen, 0)  # L1-only holders of key 0: no L0 prefix
        else:
            for p in [p for p in alive0 if not seen.get(p, 0) & 1]:
                ends0[p] = k
                alive0.discard(p)
            for p in [p for p in alive01 if p not in seen]:
                ends01[p] = k
                alive01.discard(p)
        if l2 < 0:
            if writer:
                writers[writer] = writers.get(writer, 0) + starts[r + 1] - k
            else:
                l2 = k
        if not alive01 and l2 >= 0:
            end = k  # nobody's chain can grow past here
            break
    ends0.update(dict.fromkeys(alive0, end))
    ends01.update(dict.fromkeys(alive01, end))
    return Walk(end if l2 < 0 else l2, {p: (ends0[p], ends01[p]) for p in ends01}, writers)


# ARGV: op, pod id, key ttl ms, names blob, name length, extra, pod name, registry
#   op S0/S1/S2: stored in tier; R0/R1/R2: removed; P: speculate (extra = ttl ms);
#   C: clear (extra = tier mask 1 L0, 2 L1, 4 L2 written by this pod).
#   A non-empty pod name is (re)registered under its id in the registry hash.
APPLY = r"""
local op, pod, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local blob, len, extra = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6] or '0')
if ARGV[7] ~= '' then redis.call('HSET', ARGV[8], pod, ARGV[7]) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local store = string.sub(op, 1, 1) == 'S'

local function decode(v)
  if not v then return '', {}, {} end
  local bar = string.find(v, '|', 1, true)
  local order, vals = {}, {}
  for p, x in string.gmatch(string.sub(v, bar + 1), '([^=;]+)=(%d+)') do
    order[#order + 1] = p
    vals[p] = tonumber(x)
  end
  return string.sub(v, 1, bar - 1), order, vals
end

local function encode(l2, order, vals)
  local parts = {}
  for _, p in ipairs(order) do
    local x = vals[p]
    if x % 4 > 0 or (x - x % 4) / 4 > now then
      parts[#parts + 1] = p .. '=' .. string.format('%d', x)
    end
  end
  if l2 == '' and #parts == 0 then return nil end
  return l2 .. '|' .. table.concat(parts, ';')
end

local function change(x, l2)
  local bits = x % 4
  local l0, l1 = bits % 2, (bits - bits % 2) / 2
  if op == 'S0' then return 1 + 2 * l1, l2
  elseif op == 'S1' then return x - 2 * l1 + 2, l2
  elseif op == 'S2' then return x, pod
  elseif op == 'R0' then return 2 * l1, l2
  elseif op == 'R1' then return x - 2 * l1, l2
  elseif op == 'R2' then return x, ''
  elseif op == 'P' then
    if l0 == 1 then return x, l2 end
    return bits + 4 * (now + extra), l2
  end
  -- 'C': clear the tiers in the mask
  if extra % 2 == 1 then x = 2 * l1; l0 = 0 end
  if math.floor(extra / 2) % 2 == 1 then x = x - 2 * l1 end
  if math.floor(extra / 4) % 2 == 1 and l2 == pod then l2 = '' end
  return x, l2
end

local n = #blob / len
for i = 1, n do
  local name = string.sub(blob, (i - 1) * len + 1, i * len)
  local v = redis.call('GET', name)
  local l2, order, vals = decode(v)
  local x = vals[pod]
  if x == nil then x = 0; order[#order + 1] = pod end
  x, l2 = change(x, l2)
  vals[pod] = x
  local new = encode(l2, order, vals)
  if new == nil then
    if v then redis.call('DEL', name) end
  elseif store then
    redis.call('SET', name, new, 'PX', ttl)
  elseif not v then
    redis.call('SET', name, new, 'PX', math.max(extra, 1))
  elseif new ~= v then
    redis.call('SET', name, new, 'KEEPTTL')
  end
end
return n
"""
