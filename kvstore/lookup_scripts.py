"""Lua scripts of the prefix lookup: per live worker, how many leading blocks of a prompt it
holds (on its device, or per tier of ``TIERS``), in one atomic call. One script per
``IndexConfig.lookup`` mode: the same live-registration preamble and output, with the walk
of that mode (``scan``: every key in growing chunks; ``bisect``: gallop and binary-search to
each breakpoint). Conventions: see :mod:`kvstore.scripts`.
"""

from __future__ import annotations

from kvstore.scripts import COMMON, LIVE_REGISTRATIONS

# Shared by every lookup script: the live registrations (current and with a heartbeat), the
# readers of a prompt key's holders, and the candidates of a walk.
# wids[i]: live worker id; live: slot bytes -> i; counts[i]: leading blocks of worker i.
_LOOKUP_LIVE = r"""
local wids, slots = live_registrations()
if #wids == 0 then return {} end
local live, counts = {}, {}
for i = 1, #wids do live[slot_bytes(slots[i])] = i; counts[i] = 0 end
local blob = ARGV[1]
local n = #blob / 16
-- Readers of a prompt key's holders (a value of slot bytes; false: none) in the union of the
-- tier hashes hs: key i alone (one) or keys from..to-1 (many), 0-based. A worker holds a key
-- in at most one tier; a transient double is named once.
local function key(i) return sub(blob, i * 16 + 1, i * 16 + 16) end
local function either(a, b)
  if not (a and b) then return a or b end
  for j = 1, #b, 2 do
    local sb = sub(b, j, j + 1)
    if not find_slot(a, sb) then a = a .. sb end
  end
  return a
end
local function reader(hs)
  local h1 = hs[1]
  return {
    one = function(i)
      local k = key(i)
      local v = redis.call('HGET', h1, k)
      for t = 2, #hs do v = either(v, redis.call('HGET', hs[t], k)) end
      return v
    end,
    many = function(from, to)
      local ks = split(blob, from, to)
      local vs = redis.call('HMGET', h1, unpack(ks))
      for t = 2, #hs do
        local more = redis.call('HMGET', hs[t], unpack(ks))
        for i = 1, to - from do vs[i] = either(vs[i], more[i]) end
      end
      return vs
    end,
  }
end
local dev = reader({blk_of(TIERS[1])})
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
# (a reader of one tier or of a union of tiers). One walk per IndexConfig.lookup mode.
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

# Tiers: the device walk (each worker's device depth), then for each lower tier that has any
# entry the same walk on the holders in that tier or any faster one, giving the depth of each
# worker's prefix held in those tiers; a tier's count is how far it extends the depth of the
# faster ones. Exact because each worker's union of tiers is prefix-closed too (the KV
# manager's tiers keep it so), and its device set is: so the keys past the faster tiers'
# depth are all in that tier. -> {worker_id, one count per tier of TIERS, ...}. Each lower
# tier without any entry costs one EXISTS.
_TIERS_OUT = r"""
local hs = {blk_of(TIERS[1])}
walk(dev)
local per, depth = {}, {}
for i, c in pairs(counts) do per[i] = {c}; depth[i] = c end
for t = 2, #TIERS do
  local h = blk_of(TIERS[t])
  local deeper = n > 0 and redis.call('EXISTS', h) == 1
  if deeper then hs[#hs + 1] = h; walk(reader(hs)) end
  for i in pairs(per) do
    local d = deeper and math.max(depth[i], counts[i]) or depth[i]
    per[i][t] = d - depth[i]
    depth[i] = d
  end
end
local out = {}
for i = 1, #wids do
  if per[i] then
    out[#out + 1] = wids[i]
    for t = 1, #TIERS do out[#out + 1] = per[i][t] end
  end
end
return out
"""

LOOKUP = {
    mode: COMMON + LIVE_REGISTRATIONS + _LOOKUP_LIVE + walk + _DEVICE_OUT
    for mode, walk in _WALK.items()
}
"""The lookup script of each ``IndexConfig.lookup`` mode."""

LOOKUP_TIERS = {
    mode: COMMON + LIVE_REGISTRATIONS + _LOOKUP_LIVE + walk + _TIERS_OUT
    for mode, walk in _WALK.items()
}
"""Per-tier lookup script of each ``IndexConfig.lookup`` mode (one call, like ``LOOKUP``)."""

# ARGV: worker_id, epoch -> the worker's device keys that a live worker with a lower slot
# also holds on its device ({} when the epoch is stale). One keeper per key: the lowest live
# slot holding it; every other holder may evict its copy first (the workers' fleet-aware
# eviction). O(keys the worker holds).
SPARES = (
    COMMON
    + LIVE_REGISTRATIONS
    + r"""
local slot, epoch = current(ARGV[1])
if not slot or epoch ~= ARGV[2] then return {} end
local _, slots = live_registrations()
local keepers = {}
for i = 1, #slots do
  if slots[i] < slot then keepers[#keepers + 1] = slot_bytes(slots[i]) end
end
if #keepers == 0 then return {} end
local held = redis.call('SMEMBERS', held_of(TIERS[1], slot))
local blk, out = blk_of(TIERS[1]), {}
for c = 1, #held, CH do
  local last = math.min(#held, c + CH - 1)
  local vals = redis.call('HMGET', blk, unpack(held, c, last))
  for i = c, last do
    local v = vals[i - c + 1]
    if v then
      for j = 1, #keepers do
        if find_slot(v, keepers[j]) then out[#out + 1] = held[i]; break end
      end
    end
  end
end
return out
"""
)
