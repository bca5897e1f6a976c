"""Server-side Lua for ``RedisStore``: one round trip per lookup and per event batch.

Value of one block key (a plain string, so a lookup reads thousands with one MGET)::

    <l2 writer pod id or empty>|<pod id>=<x>;<pod id>=<x>...

Pod ids are 8-character hashes of the pod name (``RedisStore.pod_id``); the
registry hash ``{kvgate:<ns>}:pods`` maps them back to names. Why not the names
themselves: real pod names are ~40 bytes, and value size is most of what a
lookup pays per key (a 2048-key walk measured +40% with such names).

``x = bits + 4 * spec_deadline_ms``: ``bits`` 1 = L0 (confirmed), 2 = L1;
``spec_deadline_ms`` (server clock, ``TIME``) > now means a speculative L0.

Keys travel as ONE argument: the block key names concatenated, all of the same
length ``len`` (``{kvgate:<ns>}:b:`` + 16 hex digits). redis-py packs arguments
in pure Python (~0.7 µs each), so 2048 separate KEYS would cost more than the
lookup itself. Every name carries the same hash tag, so they all live in the
slot of ``KEYS[1]`` (the first name), which is what Redis Cluster routes on;
open-source Redis (standalone and Cluster) lets a legacy EVAL script touch
undeclared keys of its own slot. Proxies that insist on every key in KEYS
(some managed "cluster" offerings) would need the names passed as KEYS.

The lookup walks the names in growing MGET chunks (64, 128, … 1024) so a short
match reads few keys, and only re-parses a value when it differs from the
previous one: consecutive blocks of one cached prompt usually have the very same
holders, so the common step is one string comparison.
"""

from __future__ import annotations

LOOKUP = r"""
local sub = string.sub
local blob, len = ARGV[1], tonumber(ARGV[2])  -- ARGV[3]: pod registry hash
local n = #blob / len
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function holders(v)
  local bar = string.find(v, '|', 1, true)
  local seen = {}
  for pod, x in string.gmatch(sub(v, bar + 1), '([^=;]+)=(%d+)') do
    x = tonumber(x)
    local bits = x % 4
    if bits % 2 == 0 and (x - bits) / 4 > now then bits = bits + 1 end
    if bits > 0 then seen[pod] = bits end
  end
  return seen, sub(v, 1, bar - 1)
end

local order, l0, l01, writers = {}, {}, {}, {}
local nalive, l2, l2alive, writer, runstart = 0, 0, true, '', 1
local prev, i, chunk, walked = 0, 1, 64, -1
while i <= n and walked < 0 do
  local last = math.min(n, i + chunk - 1)
  local names, c, off = {}, 0, (i - 1) * len
  for _ = i, last do
    c = c + 1
    names[c] = sub(blob, off + 1, off + len)
    off = off + len
  end
  local vals = redis.call('MGET', unpack(names))
  for j = 1, c do
    local v = vals[j]
    if v ~= prev then
      local k = i + j - 1
      if not v then walked = k - 1 break end
      if l2alive and k > 1 then writers[writer] = (writers[writer] or 0) + k - runstart end
      local seen, w = holders(v)
      if k == 1 then
        for pod, bits in pairs(seen) do
          order[#order + 1] = pod
          nalive = nalive + 1
          l01[pod] = -1
          if bits % 2 == 1 then l0[pod] = -1 else l0[pod] = 0 end
        end
      else
        for _, pod in ipairs(order) do
          local bits = seen[pod] or 0
          if l0[pod] == -1 and bits % 2 == 0 then l0[pod] = k - 1 end
          if l01[pod] == -1 and bits == 0 then l01[pod] = k - 1; nalive = nalive - 1 end
        end
      end
      if w == '' and l2alive then l2 = k - 1; l2alive = false end
      writer, runstart, prev = w, k, v
      if nalive == 0 and not l2alive then walked = k - 1 break end
    end
  end
  i = last + 1
  chunk = math.min(chunk * 2, 1024)
end
if walked < 0 then walked = n end
if l2alive then
  l2 = walked
  if walked >= runstart then writers[writer] = (writers[writer] or 0) + walked - runstart + 1 end
end

-- one HMGET turns the (few) pod ids of the answer back into names
local ids = {}
for _, pod in ipairs(order) do ids[#ids + 1] = pod end
for w, _ in pairs(writers) do ids[#ids + 1] = w end
local names = {}
if #ids > 0 then names = redis.call('HMGET', ARGV[3], unpack(ids)) end
local out = {l2, #order}
for i, pod in ipairs(order) do
  local a, b = l0[pod], l01[pod]
  if a == -1 then a = walked end
  if b == -1 then b = walked end
  out[#out + 1] = names[i] or pod; out[#out + 1] = a; out[#out + 1] = b
end
for i = #order + 1, #ids do
  out[#out + 1] = names[i] or ids[i]; out[#out + 1] = writers[ids[i]]
end
return out
"""

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
