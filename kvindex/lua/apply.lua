-- APPLY: one batch of index writes for one pod, on the values described in
-- kvindex/redis_scripts.py. Returns the number of keys written.
--
-- ARGV, named here in the order kvindex.redis_scripts.ApplyArgs.argv() sends them
-- (a test checks that these names and that order match the dataclass):
local op = ARGV[1]  -- S0/S1/S2: stored in tier; R0/R1/R2: removed; P: speculate; C: clear
local pod_id = ARGV[2]  -- the pod as stored in values (8 chars)
local key_ttl_ms = tonumber(ARGV[3])  -- TTL of block keys written by a store
local names = ARGV[4]  -- the keys' names concatenated, name_len bytes each
local name_len = tonumber(ARGV[5])
local extra = tonumber(ARGV[6] or '0')  -- P: speculation ttl ms; C: tier mask (1 L0, 2 L1, 4 L2)
local pod_name = ARGV[7]  -- non-empty: (re)register pod_id -> pod_name in the registry hash
local registry = ARGV[8]
local offsets = ARGV[9] or ''  -- positions (empty when unknown): one hex digit per key,
local anchors = ARGV[10] or ''  -- 16 hex digits per key,
local parents = ARGV[11] or ''  -- 16 hex digits per key
local root = ARGV[12] or ''  -- the namespace root "{kvgate:<ns>}:"
if pod_name ~= '' then redis.call('HSET', registry, pod_id, pod_name) end
local bp, sp, gp = root .. 'b:', root .. 's:', root .. 'g:'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local store = string.sub(op, 1, 1) == 'S'
local GROUP, MAX_ENDS = 16, 32

-- A value without the '|' after its writer was not written by this script (corrupt,
-- or another version's): it decodes as held by nobody, so the write replaces it
-- instead of failing on it (each failure would trip every replica's breaker).
local function decode(v)
  local bar = v and string.find(v, '|', 1, true)
  if not bar then return '', {}, {} end
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
  elseif op == 'S2' then return x, pod_id
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
  if math.floor(extra / 4) % 2 == 1 and l2 == pod_id then l2 = '' end
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
  redis.call('SET', sname, epoch .. '#' .. table.concat(runs, '/'), 'PX', minttl or key_ttl_ms)
end

-- Clear ``pod_id`` in a summary the way the same op clears its blocks: run by run.
local function clear_runs(v)
  local out = {}
  for count, value in string.gmatch(v, '(%d+)%*([^/]*)') do
    local l2, order, vals = decode(value ~= '' and value or nil)
    local x = vals[pod_id] or 0
    x, l2 = change(x, l2)
    if vals[pod_id] ~= nil then vals[pod_id] = x end
    out[#out + 1] = count .. '*' .. (encode(l2, order, vals) or '')
  end
  return table.concat(out, '/')
end
local blind = false  -- a removal of unknown position: no summary can be trusted
local touched = {}  -- group hashes written: their TTL is refreshed once
local n = #names / name_len
for i = 1, n do
  local name = string.sub(names, (i - 1) * name_len + 1, i * name_len)
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
    local x = vals[pod_id]
    if x == nil then x = 0; order[#order + 1] = pod_id end
    x, l2 = change(x, l2)
    vals[pod_id] = x
    new = encode(l2, order, vals)
  end
  if summary then
    if v and new ~= v then redis.call('SET', name, new, 'KEEPTTL') end
  elseif new == nil then
    if v then redis.call('DEL', name) end
  elseif store then
    redis.call('SET', name, new, 'PX', key_ttl_ms)
  elseif not v then
    redis.call('SET', name, new, 'PX', math.max(extra, 1))
  elseif new ~= v then
    redis.call('SET', name, new, 'KEEPTTL')
  end
  if root ~= '' and not summary then
    local o = offsets ~= '' and tonumber(string.sub(offsets, i, i), 16) or nil
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
for _, g in ipairs(touched) do redis.call('PEXPIRE', g, key_ttl_ms) end
if blind then redis.call('INCR', root .. 'epoch') end
if #ends > 0 then
  local epoch = redis.call('GET', root .. 'epoch') or '0'
  for _, ge in ipairs(ends) do summarize(ge[1], ge[2], epoch) end
end
return n
