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

A group summary (``s:`` key) is ``<epoch>#<n>*<value>/<n>*<value>...``: the
values of the group's 16 blocks in chain order, run-length encoded (``value``
empty where nobody holds the block). ``APPLY`` rewrites it whenever one of its
blocks changes, with the group hashes described in ``RedisStore``'s docstring.

Reads are NOT a script: ``RedisStore`` sends ``TIME`` and ``MGET`` (all keys
declared, so any Cluster proxy accepts it) and walks the reply here, in
``prefix_walk``. Why: a Lua walk over 2048 keys spent ~0.55-0.8 ms of Redis time
turning names into Lua strings and back, and a script that only reads the
summaries still costs ~200 µs (its 32 KB argument alone ~45 µs: Redis hashes Lua
strings in full) against ~20 µs for the MGET. Redis is the shared resource; the
gateway replica, which scales out, does the walk with C-level list operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, islice
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


def prefix_walk(
    values: Sequence[bytes | None], now_ms: int, sizes: Sequence[int] | None = None
) -> Walk:
    """Consecutive prefixes over ``values`` (MGET order; None = key absent), exactly.

    ``sizes``: how many blocks each value stands for (a group summary stands for
    16); by default one each. Positions in the result count blocks.

    Consecutive blocks of one cached prompt nearly always hold the same bytes, so
    the walk visits *runs* of equal values: the run starts come from one C-level
    pass (``map(ne, …)``), and Python only decodes each distinct value once and
    updates the per-pod chains where the value changes. Cost: one pass in C per
    lookup plus a few µs per run. The walk stops at the first key nobody holds
    (absent, or only expired speculation and no L2 copy)."""
    n = len(values)
    if not n or values[0] is None:
        return Walk(0, {}, {})
    at = range(n + 1) if sizes is None else [0, *accumulate(sizes)]  # item -> first block
    starts = [0, *compress(range(1, n), map(ne, values, islice(values, 1, None))), n]
    decoded: dict[bytes, tuple[dict[str, int], str]] = {}
    alive0: set[str] = set()  # pods whose L0 chain is unbroken
    alive01: set[str] = set()  # pods whose L0∪L1 chain is unbroken
    ends0: dict[str, int] = {}
    ends01: dict[str, int] = {}
    writers: dict[str, int] = {}
    l2, end = -1, at[n]  # l2 < 0: the L2 chain is unbroken
    for r in range(len(starts) - 1):
        v = values[starts[r]]
        k = at[starts[r]]
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
                writers[writer] = writers.get(writer, 0) + at[starts[r + 1]] - k
            else:
                l2 = k
        if not alive01 and l2 >= 0:
            end = k  # nobody's chain can grow past here
            break
    ends0.update(dict.fromkeys(alive0, end))
    ends01.update(dict.fromkeys(alive01, end))
    return Walk(end if l2 < 0 else l2, {p: (ends0[p], ends01[p]) for p in ends01}, writers)


# ARGV: op, pod id, key ttl ms, names blob, name length, extra, pod name, registry,
#   offsets, anchors blob, parents blob, namespace root ("{kvgate:<ns>}:")
#   op S0/S1/S2: stored in tier; R0/R1/R2: removed; P: speculate (extra = ttl ms);
#   C: clear (extra = tier mask 1 L0, 2 L1, 4 L2 written by this pod); its names
#   may be block or summary keys (SCAN).
#   A non-empty pod name is (re)registered under its id in the registry hash.
#   Positions (see ``kvindex.store.Positions``; empty when unknown): offsets is
#   one hex digit per key, anchors and parents 16 hex digits per key.
APPLY = r"""
local op, pod, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local blob, len, extra = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6] or '0')
if ARGV[7] ~= '' then redis.call('HSET', ARGV[8], pod, ARGV[7]) end
local offs, anchors, parents = ARGV[9] or '', ARGV[10] or '', ARGV[11] or ''
local root = ARGV[12] or ''
local bp, sp, gp = root .. 'b:', root .. 's:', root .. 'g:'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local store = string.sub(op, 1, 1) == 'S'
local GROUP, MAX_ENDS = 16, 32

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

-- Group summaries: ``s:<E>`` holds, for the group that ends with block E (offset
-- 15), the values of its 16 blocks run-length encoded, prefixed by the epoch. The
-- hash ``g:<anchor>`` holds the group's structure: per member its parent (the
-- anchor: itself) followed by the ends whose summaries include it (16 hex digits
-- each, at most MAX_ENDS ends; an end that does not fit gets no summary). Every
-- write to a member rewrites the summaries that include it, so a summary always
-- equals its blocks' values.
local ends, wanted = {}, {}
local function want(g, e)
  local id = g .. ' ' .. e
  if not wanted[id] then wanted[id] = true; ends[#ends + 1] = {g, e} end
end

local function listed(list, e)
  local at = 1
  while true do
    local found = string.find(list, e, at, true)
    if not found then return false end
    if (found - 1) % 16 == 0 then return true end
    at = found + 1
  end
end

local function summarize(g, e, epoch)
  local sname = sp .. e
  local members, cur = {e}, e
  local records = {}
  for i = 1, GROUP - 1 do
    local record = redis.call('HGET', g, cur)
    if not record then break end
    records[i] = record
    cur = string.sub(record, 1, 16)
    members[#members + 1] = cur
  end
  if #members < GROUP or gp .. cur ~= g then redis.call('DEL', sname); return end
  records[GROUP] = redis.call('HGET', g, cur) or cur  -- the anchor's
  for i = 1, GROUP do  -- list e among every member's ends
    local record = records[i]
    if not listed(string.sub(record, 17), e) then
      if #record >= (MAX_ENDS + 1) * 16 then  -- full: forget ends without a summary
        local kept = string.sub(record, 1, 16)
        for j = 17, #record, 16 do
          local other = string.sub(record, j, j + 15)
          if redis.call('EXISTS', sp .. other) == 1 then kept = kept .. other end
        end
        record = kept
        if #record >= (MAX_ENDS + 1) * 16 then redis.call('DEL', sname); return end
      end
      redis.call('HSET', g, members[i], record .. e)
    end
  end
  -- the group's block values in chain order, run-length encoded: "<n>*<value>/..."
  local runs, last, count, minttl, held = {}, nil, 0, nil, false
  for i = GROUP, 1, -1 do
    local bname = bp .. members[i]
    local v = redis.call('GET', bname) or ''
    if v ~= '' then
      held = true
      local pt = redis.call('PTTL', bname)
      if pt > 0 and (minttl == nil or pt < minttl) then minttl = pt end
    end
    if v == last then
      count = count + 1
    else
      if last ~= nil then runs[#runs + 1] = count .. '*' .. last end
      last, count = v, 1
    end
  end
  runs[#runs + 1] = count .. '*' .. last
  if not held then redis.call('DEL', sname); return end
  redis.call('SET', sname, epoch .. '#' .. table.concat(runs, '/'), 'PX', minttl or ttl)
end

-- Clear ``pod`` in a summary the way the same op clears its blocks: run by run.
local function clear_runs(v)
  local out = {}
  for count, value in string.gmatch(v, '(%d+)%*([^/]*)') do
    local l2, order, vals = decode(value ~= '' and value or nil)
    local x = vals[pod] or 0
    x, l2 = change(x, l2)
    if vals[pod] ~= nil then vals[pod] = x end
    out[#out + 1] = count .. '*' .. (encode(l2, order, vals) or '')
  end
  return table.concat(out, '/')
end
local blind = false  -- a removal of unknown position: no summary can be trusted
local touched = {}  -- group hashes written: their TTL is refreshed once
local n = #blob / len
for i = 1, n do
  local name = string.sub(blob, (i - 1) * len + 1, i * len)
  local summary = root ~= '' and string.sub(name, 1, #sp) == sp
  local v = redis.call('GET', name)
  local new
  if summary then  -- only a Cleared reaches summaries (SCAN)
    if v then
      local hash = string.find(v, '#', 1, true) or 0
      new = string.sub(v, 1, hash) .. clear_runs(string.sub(v, hash + 1))
    end
  else
    local l2, order, vals = decode(v)
    local x = vals[pod]
    if x == nil then x = 0; order[#order + 1] = pod end
    x, l2 = change(x, l2)
    vals[pod] = x
    new = encode(l2, order, vals)
  end
  if summary then
    if v and new ~= v then redis.call('SET', name, new, 'KEEPTTL') end
  elseif new == nil then
    if v then redis.call('DEL', name) end
  elseif store then
    redis.call('SET', name, new, 'PX', ttl)
  elseif not v then
    redis.call('SET', name, new, 'PX', math.max(extra, 1))
  elseif new ~= v then
    redis.call('SET', name, new, 'KEEPTTL')
  end
  if root ~= '' and not summary then
    local o = offs ~= '' and tonumber(string.sub(offs, i, i), 16) or nil
    if o == nil then
      if not store and op ~= 'P' and op ~= 'C' then blind = true end
    else
      local hex = string.sub(name, -16)
      local g = gp .. string.sub(anchors, (i - 1) * 16 + 1, i * 16)
      local record = redis.call('HGET', g, hex)
      if store or op == 'P' then
        if not record then  -- a key's parent never changes: only the first write sets it
          redis.call('HSET', g, hex, string.sub(parents, (i - 1) * 16 + 1, i * 16))
        end
        if not touched[g] then touched[g] = true; touched[#touched + 1] = g end
      end
      if o == GROUP - 1 then want(g, hex) end
      if record then
        for j = 17, #record, 16 do want(g, string.sub(record, j, j + 15)) end
      end
    end
  end
end
for _, g in ipairs(touched) do redis.call('PEXPIRE', g, ttl) end
if blind then redis.call('INCR', root .. 'epoch') end
if #ends > 0 then
  local epoch = redis.call('GET', root .. 'epoch') or '0'
  for _, ge in ipairs(ends) do summarize(ge[1], ge[2], epoch) end
end
return n
"""
