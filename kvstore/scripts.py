"""Lua scripts: every index operation is one atomic server-side call (one round trip).

Conventions shared by all scripts (see the schema in :mod:`kvstore`):

* ``KEYS[1]`` is the registry hash ``<ns>reg``; the namespace is ``KEYS[1]`` minus ``reg``.
  Other keys share its hash tag, so the scripts also run on Redis Cluster.
* A slot id travels as decimal text between scripts and as 2 big-endian bytes inside ``blk``
  values, which are kept sorted so that two blocks held by the same slots have equal values
  (Lua interns strings, so comparing them is O(1)).
* Invariant kept by every script: key in ``held:<slot>`` iff slot in ``blk[key]``, so
  membership is tested on ``blk`` (which the lookup reads anyway). The host tier has the same
  pair, ``hblk`` and ``hheld:<slot>``.
* Block keys travel as one blob of concatenated 16-byte keys per argument.
* Batches are cut into chunks of at most ``CH`` keys so ``unpack`` stays under Lua's C stack.
"""

from __future__ import annotations

_COMMON = r"""
local ns = string.sub(KEYS[1], 1, -4)
local CH = 2000
local function slot_bytes(slot) return string.char(math.floor(slot / 256), slot % 256) end
-- current registration of a worker: slot (number), epoch (string), or nil
local function current(wid)
  local cur = redis.call('HGET', KEYS[1], wid)
  if not cur then return nil end
  local slot, epoch = string.match(cur, '^(%d+):(%d+)$')
  return tonumber(slot), epoch
end
local sub, byte, find = string.sub, string.byte, string.find
-- keys from..to (0-based, exclusive end) of a blob of 16-byte keys, as a table
local function split(blob, from, to)
  local ks, n = {}, 0
  for i = from * 16 + 1, to * 16, 16 do n = n + 1; ks[n] = sub(blob, i, i + 15) end
  return ks
end
-- value with slot s (2 bytes, number n) inserted in sorted order
local function with_slot(v, s, n)
  if not v then return s end
  for j = 1, #v, 2 do
    local c = byte(v, j) * 256 + byte(v, j + 1)
    if c == n then return v end
    if c > n then return sub(v, 1, j - 1) .. s .. sub(v, j) end
  end
  return v .. s
end
-- position of slot bytes s in v (2-byte aligned), or nil
local function find_slot(v, s)
  local i = 1
  while true do
    local p = find(v, s, i, true)
    if not p then return nil end
    if p % 2 == 1 then return p end
    i = p + 1
  end
end
-- Store keys ks[from..to] for slot (bytes s, number n); returns entries added.
local function store(blk, held, ks, s, n)
  local added = 0
  for c = 1, #ks, CH do
    local last = math.min(#ks, c + CH - 1)
    local vals = redis.call('HMGET', blk, unpack(ks, c, last))
    local set, new, ns_, nn = {}, {}, 0, 0
    for i = c, last do
      local v = vals[i - c + 1]
      if not v or not find_slot(v, s) then
        ns_ = ns_ + 2; set[ns_ - 1] = ks[i]; set[ns_] = with_slot(v, s, n)
        nn = nn + 1; new[nn] = ks[i]
      end
    end
    if nn > 0 then
      redis.call('HSET', blk, unpack(set))
      added = added + redis.call('SADD', held, unpack(new))
    end
  end
  return added
end
-- Remove slot bytes s from keys ks; returns entries removed.
local function drop(blk, held, ks, s)
  local removed = 0
  for c = 1, #ks, CH do
    local last = math.min(#ks, c + CH - 1)
    local vals = redis.call('HMGET', blk, unpack(ks, c, last))
    local set, del, gone, ns_, nd, ng = {}, {}, {}, 0, 0, 0
    for i = c, last do
      local v = vals[i - c + 1]
      local p = v and find_slot(v, s)
      if p then
        ng = ng + 1; gone[ng] = ks[i]
        v = sub(v, 1, p - 1) .. sub(v, p + 2)
        if v == '' then nd = nd + 1; del[nd] = ks[i] else
          ns_ = ns_ + 2; set[ns_ - 1] = ks[i]; set[ns_] = v end
      end
    end
    if ns_ > 0 then redis.call('HSET', blk, unpack(set)) end
    if nd > 0 then redis.call('HDEL', blk, unpack(del)) end
    if ng > 0 then removed = removed + redis.call('SREM', held, unpack(gone)) end
  end
  return removed
end
"""

# ARGV: worker_id, ttl_ms, heartbeat payload -> {epoch (text), slot} or error KVC_FULL
REGISTER = (
    _COMMON
    + r"""
local wid = ARGV[1]
-- epochs grow even across a Redis that lost its data: max(last + 1, server time in ms)
local t = redis.call('TIME')
local last = tonumber(redis.call('HGET', ns .. 'epoch', wid) or '0')
local epoch = math.max(last + 1, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('HSET', ns .. 'epoch', wid, string.format('%d', epoch))
epoch = string.format('%d', epoch)
local old = current(wid)
if old then redis.call('DEL', ns .. 'hb:' .. old) end  -- superseded: ignored at once
local slot = redis.call('SPOP', ns .. 'free')
if slot then
  slot = tonumber(slot)
else
  slot = redis.call('INCR', ns .. 'nslot') - 1
  if slot > 65535 then
    redis.call('DECR', ns .. 'nslot')
    return redis.error_reply('KVC_FULL all 65536 registration slots are in use')
  end
end
redis.call('HSET', KEYS[1], wid, slot .. ':' .. epoch)
redis.call('HSET', ns .. 'slots', slot, epoch .. ':' .. wid)
redis.call('HSET', ns .. 'seq', slot, 0)
redis.call('DEL', ns .. 'held:' .. slot, ns .. 'hheld:' .. slot)
redis.call('SET', ns .. 'hb:' .. slot, ARGV[3], 'PX', ARGV[2])
return {epoch, slot}
"""
)

# ARGV: worker_id, epoch, ttl_ms, payload -> 1 accepted, 0 stale
HEARTBEAT = (
    _COMMON
    + r"""
local slot, epoch = current(ARGV[1])
if not slot or epoch ~= ARGV[2] then return 0 end
redis.call('SET', ns .. 'hb:' .. slot, ARGV[4], 'PX', ARGV[3])
return 1
"""
)

# ARGV: worker_id, epoch -> 1 deregistered, 0 stale. Entries are purged by purge_dead.
DEREGISTER = (
    _COMMON
    + r"""
local slot, epoch = current(ARGV[1])
if not slot or epoch ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', ns .. 'hb:' .. slot)
return 1
"""
)

# ARGV: worker_id, epoch, batch_seq, then (op, blob) pairs with op in S/R/s/r/C (s, r: host)
# -> {0, added, removed} applied | {-1} stale epoch | {-2} duplicate | {-3, last} gap
APPLY = (
    _COMMON
    + r"""
local slot, epoch = current(ARGV[1])
if not slot or epoch ~= ARGV[2] then return {-1} end
local last = tonumber(redis.call('HGET', ns .. 'seq', slot) or '0')
local bseq = tonumber(ARGV[3])
if bseq <= last then return {-2} end
if bseq ~= last + 1 then return {-3, last} end
local blk, held, s = ns .. 'blk', ns .. 'held:' .. slot, slot_bytes(slot)
local hblk, hheld = ns .. 'hblk', ns .. 'hheld:' .. slot
local added, removed = 0, 0
for a = 4, #ARGV, 2 do
  local op, blob = ARGV[a], ARGV[a + 1]
  if op == 'C' then
    removed = removed + drop(blk, held, redis.call('SMEMBERS', held), s)
    removed = removed + drop(hblk, hheld, redis.call('SMEMBERS', hheld), s)
  elseif op == 'S' then
    added = added + store(blk, held, split(blob, 0, #blob / 16), s, slot)
  elseif op == 'R' then
    removed = removed + drop(blk, held, split(blob, 0, #blob / 16), s)
  elseif op == 's' then
    added = added + store(hblk, hheld, split(blob, 0, #blob / 16), s, slot)
  else
    removed = removed + drop(hblk, hheld, split(blob, 0, #blob / 16), s)
  end
end
redis.call('HSET', ns .. 'seq', slot, bseq)
return {0, added, removed}
"""
)

# ARGV: worker_id, epoch, batch_seq, blob of every recorded key the worker holds on its
# device, blob of those in its host tier -> {0, added, removed} | {-1} stale epoch
RESYNC = (
    _COMMON
    + r"""
local slot, epoch = current(ARGV[1])
if not slot or epoch ~= ARGV[2] then return {-1} end
local s = slot_bytes(slot)
local added, removed = 0, 0
local function replace(blk, held, blob)
  local want = split(blob, 0, #blob / 16)
  local keep = {}
  for _, k in ipairs(want) do keep[k] = true end
  local gone, ng = {}, 0
  for _, k in ipairs(redis.call('SMEMBERS', held)) do
    if not keep[k] then ng = ng + 1; gone[ng] = k end
  end
  removed = removed + drop(blk, held, gone, s)
  added = added + store(blk, held, want, s, slot)
end
replace(ns .. 'blk', ns .. 'held:' .. slot, ARGV[4])
replace(ns .. 'hblk', ns .. 'hheld:' .. slot, ARGV[5] or '')
redis.call('HSET', ns .. 'seq', slot, ARGV[3])
return {0, added, removed}
"""
)

# ARGV: worker_id, tier ('held' or 'hheld') -> every key its current registration holds there
HELD = (
    _COMMON
    + r"""
local slot = current(ARGV[1])
if not slot then return {} end
return redis.call('SMEMBERS', ns .. (ARGV[2] or 'held') .. ':' .. slot)
"""
)

# Shared by every lookup script: the live registrations (current and with a heartbeat), the
# readers of a prompt key's holders, and the candidates of a walk.
# wids[i]: worker id; live: slot bytes -> i; counts[i]: leading blocks of a live worker.
_LOOKUP_LIVE = r"""
local regs = redis.call('HGETALL', KEYS[1])
local wids, slots, hbkeys = {}, {}, {}
for i = 1, #regs, 2 do
  local slot = string.match(regs[i + 1], '^(%d+):')
  wids[#wids + 1] = regs[i]
  slots[#slots + 1] = tonumber(slot)
  hbkeys[#hbkeys + 1] = ns .. 'hb:' .. slot
end
if #wids == 0 then return {} end
local hb = redis.call('MGET', unpack(hbkeys))
local live, counts = {}, {}
for i = 1, #wids do
  if hb[i] then live[slot_bytes(slots[i])] = i; counts[i] = 0 end
end
local blob = ARGV[1]
local n = #blob / 16
local blk, hblk = ns .. 'blk', ns .. 'hblk'
-- Readers of a prompt key's holders (a value of slot bytes; false: none): key i alone (one)
-- or keys from..to-1 (many), 0-based; on the device, or in either tier (union). A worker
-- holds a key in at most one tier; a transient double is named once.
local function key(i) return sub(blob, i * 16 + 1, i * 16 + 16) end
local function either(a, b)
  if not (a and b) then return a or b end
  for j = 1, #b, 2 do
    local sb = sub(b, j, j + 1)
    if not find_slot(a, sb) then a = a .. sb end
  end
  return a
end
local dev = {
  one = function(i) return redis.call('HGET', blk, key(i)) end,
  many = function(from, to) return redis.call('HMGET', blk, unpack(split(blob, from, to))) end,
}
local union = {
  one = function(i)
    local k = key(i)
    return either(redis.call('HGET', blk, k), redis.call('HGET', hblk, k))
  end,
  many = function(from, to)
    local ks = split(blob, from, to)
    local dv, hv = redis.call('HMGET', blk, unpack(ks)), redis.call('HMGET', hblk, unpack(ks))
    for i = 1, to - from do dv[i] = either(dv[i], hv[i]) end
    return dv
  end,
}
-- A walk's candidates: live slots holding every key read so far (slot bytes -> true).
local active, nactive = {}, 0
local function start(v)  -- v: holders of the first key; every live count restarts at 0
  active, nactive = {}, 0
  for i in pairs(counts) do counts[i] = 0 end
  if not v then return end
  for j = 1, #v, 2 do
    local sb = sub(v, j, j + 1)
    if live[sb] then active[sb] = true; nactive = nactive + 1 end
  end
end
local function leave(v, at)  -- candidates that v does not name stop, with count at
  for sb in pairs(active) do
    if not v or not find_slot(v, sb) then
      counts[live[sb]] = at; active[sb] = nil; nactive = nactive - 1
    end
  end
end
"""

# walk(read): counts[i] = leading prompt keys live worker i holds, reading holders with read
# (dev or union). One walk per IndexConfig.lookup mode.
#
# Scan: read every key in growing chunks (1, 64, 256, 1024, 1024, ...) until no candidate is
# left; a candidate's count is the index of the first key it lacks. Exact for any index.
_WALK_SCAN = r"""
local function walk(read)
  local prev = n > 0 and read.one(0) or nil
  start(prev)
  local pos, chunk = 1, 64
  while nactive > 0 and pos < n do
    local to = math.min(n, pos + chunk)
    local vs = read.many(pos, to)
    for i = 1, to - pos do
      local v = vs[i]
      if v ~= prev then  -- equal values (same holders) are the common case: O(1)
        leave(v, pos + i - 1)
        if nactive == 0 then break end
        prev = v
      end
    end
    pos = to
    chunk = math.min(chunk * 4, 1024)
  end
  for sb in pairs(active) do counts[live[sb]] = n end
end
"""

# Bisect: exact when every live slot's key set is prefix-closed (see kvstore's docstring), so
# that along the prompt the candidates holding key i only shrink. From an index lo that every
# candidate holds, gallop (lo+1, lo+2, lo+4, ..., n-1) to the first probe some candidate lacks,
# binary-search the gap for the first such index b, give the candidates missing at b the count
# b, continue from b with the rest. O(breakpoints x log n) reads instead of n keys.
_WALK_BISECT = r"""
local function walk(read)
  local lov = n > 0 and read.one(0) or nil
  start(lov)
  -- does value pv name every candidate? (pv == lov, the value at lo, is the O(1) common case)
  local function all_hold(pv)
    if pv == lov then return true end
    if not pv or #pv < 2 * nactive then return false end
    local c = 0
    for j = 1, #pv, 2 do if active[sub(pv, j, j + 1)] then c = c + 1 end end
    return c == nactive
  end
  local lo = 0
  while nactive > 0 do
    local good, bad, badv, step = lo, nil, nil, 1
    while good < n - 1 do  -- gallop: first probe that some candidate lacks
      local p = math.min(lo + step, n - 1)
      local pv = read.one(p)
      if all_hold(pv) then good = p else bad, badv = p, pv; break end
      step = step * 2
    end
    if not bad then break end  -- the candidates left hold the whole prompt
    while bad - good > 1 do  -- binary search: good is held by all, bad is not
      local m = math.floor((good + bad) / 2)
      local mv = read.one(m)
      if all_hold(mv) then good = m else bad, badv = m, mv end
    end
    leave(badv, bad)
    lo, lov = bad, badv
  end
  for sb in pairs(active) do counts[live[sb]] = n end
end
"""

_WALK = {"bisect": _WALK_BISECT, "scan": _WALK_SCAN}

# ARGV: blob of the prompt's recorded keys, in order
# -> {worker_id, leading blocks held, ...} for every live worker
_DEVICE_OUT = r"""
walk(dev)
local out = {}
for i = 1, #wids do
  if counts[i] then out[#out + 1] = wids[i]; out[#out + 1] = counts[i] end
end
return out
"""

# Tiers: the device walk (each worker's device depth d), then the same walk on the holders in
# either tier, giving the depth u of its device-or-host prefix. Exact because each worker's
# union is prefix-closed too (worker/kv/host_tier.py), and its device set is: so keys d..u-1
# are all in its host tier. -> {worker_id, d, u - d, ...}. Without any host-tier entry it
# costs one EXISTS more than the device lookup.
_TIERS_OUT = r"""
walk(dev)
local dev = {}
for i, c in pairs(counts) do dev[i] = c end
if n > 0 and redis.call('EXISTS', hblk) == 1 then walk(union) end
local out = {}
for i = 1, #wids do
  if dev[i] then
    out[#out + 1] = wids[i]; out[#out + 1] = dev[i]
    out[#out + 1] = math.max(0, counts[i] - dev[i])
  end
end
return out
"""

LOOKUP = {mode: _COMMON + _LOOKUP_LIVE + walk + _DEVICE_OUT for mode, walk in _WALK.items()}
"""The lookup script of each ``IndexConfig.lookup`` mode."""

LOOKUP_TIERS = {mode: _COMMON + _LOOKUP_LIVE + walk + _TIERS_OUT for mode, walk in _WALK.items()}
"""Per-tier lookup script of each ``IndexConfig.lookup`` mode (one call, like ``LOOKUP``)."""

# -> {worker_id, "slot:epoch", heartbeat payload, ...} for every live worker
LIVE = (
    _COMMON
    + r"""
local regs = redis.call('HGETALL', KEYS[1])
if #regs == 0 then return {} end
local hbkeys = {}
for i = 1, #regs, 2 do
  hbkeys[#hbkeys + 1] = ns .. 'hb:' .. string.match(regs[i + 1], '^(%d+):')
end
local hb = redis.call('MGET', unpack(hbkeys))
local out = {}
for i = 1, #hbkeys do
  if hb[i] then
    out[#out + 1] = regs[2 * i - 1]; out[#out + 1] = regs[2 * i]; out[#out + 1] = hb[i]
  end
end
return out
"""
)

# ARGV: max registrations -> {slot, record, ...} of dead ones (superseded, deregistered, or
# without heartbeat; the latter are unregistered here so their worker must register again)
PURGE_SCAN = (
    _COMMON
    + r"""
local regs = redis.call('HGETALL', KEYS[1])
local cur = {}
for i = 1, #regs, 2 do cur[regs[i]] = string.match(regs[i + 1], '^(%d+):') end
local recs = redis.call('HGETALL', ns .. 'slots')
local out, max = {}, tonumber(ARGV[1])
for i = 1, #recs, 2 do
  if #out >= 2 * max then break end
  local slot, rec = recs[i], recs[i + 1]
  local wid = string.match(rec, '^%d+:(.*)$')
  local dead = cur[wid] ~= slot
  if not dead and redis.call('EXISTS', ns .. 'hb:' .. slot) == 0 then
    redis.call('HDEL', KEYS[1], wid)
    dead = true
  end
  if dead then out[#out + 1] = slot; out[#out + 1] = rec end
end
return out
"""
)

# ARGV: slot, record (as PURGE_SCAN returned it), chunk
# -> remaining keys (0: slot freed) | -1 the slot was freed or reused meanwhile
PURGE_SLOT = (
    _COMMON
    + r"""
local slot, rec = ARGV[1], ARGV[2]
if redis.call('HGET', ns .. 'slots', slot) ~= rec then return -1 end
local wid = string.match(rec, '^%d+:(.*)$')
local cur = current(wid)
if cur and tostring(cur) == slot then return -1 end
local held, hheld = ns .. 'held:' .. slot, ns .. 'hheld:' .. slot
local sb = slot_bytes(tonumber(slot))
drop(ns .. 'blk', held, redis.call('SPOP', held, tonumber(ARGV[3])), sb)
local left = redis.call('SCARD', held)
if left == 0 then  -- then the host tier's entries, in chunks too
  drop(ns .. 'hblk', hheld, redis.call('SPOP', hheld, tonumber(ARGV[3])), sb)
  left = redis.call('SCARD', hheld)
end
if left == 0 then
  redis.call('HDEL', ns .. 'slots', slot)
  redis.call('HDEL', ns .. 'seq', slot)
  redis.call('DEL', ns .. 'hb:' .. slot)
  redis.call('SADD', ns .. 'free', slot)
end
return left
"""
)
