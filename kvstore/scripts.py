"""Lua scripts: every index operation is one atomic server-side call (one round trip).

Conventions shared by all scripts (see the schema in :mod:`kvstore`):

* ``KEYS[1]`` is the registry hash ``<ns>reg``; the namespace is ``KEYS[1]`` minus ``reg``.
  Other keys share its hash tag, so the scripts also run on Redis Cluster.
* A slot id travels as decimal text between scripts and as 2 big-endian bytes inside ``blk``
  values, which are kept sorted so that two blocks held by the same slots have equal values
  (Lua interns strings, so comparing them is O(1)).
* Every tier of :data:`~kvstore.blocks.tiers.HELD_TIERS` has its pair of entries, named by
  the tier's value: ``blk:<tier>`` and ``held:<tier>:<slot>`` (``TIERS`` below lists them,
  fastest first). Invariant kept by every script: key in ``held:<tier>:<slot>`` iff slot in
  ``blk:<tier>[key]``, so membership is tested on ``blk:<tier>`` (which the lookup reads
  anyway).
* Block keys travel as one blob of concatenated 16-byte keys per argument.
* Batches are cut into chunks of at most ``CH`` keys so ``unpack`` stays under Lua's C stack.

The scripts here keep the block entries (apply a batch of events, resync, list a worker's
keys); the registry's (register, heartbeat, deregister, the live workers, purges) are in
:mod:`kvstore.registry_scripts`, the prefix lookups (one script per lookup mode) in
:mod:`kvstore.lookup_scripts`.
"""

from __future__ import annotations

from kvstore.blocks.tiers import HELD_TIERS

_TIER_LIST = ", ".join(f"'{tier.value}'" for tier in HELD_TIERS)

COMMON = (
    f"""
local TIERS = {{{_TIER_LIST}}}
"""
    + r"""
local ns = string.sub(KEYS[1], 1, -4)
local CH = 2000
local IS_TIER = {}
for _, t in ipairs(TIERS) do IS_TIER[t] = true end
-- the entries of one tier: key -> holders (hash), and one slot's keys there (set)
local function blk_of(tier) return ns .. 'blk:' .. tier end
local function held_of(tier, slot) return ns .. 'held:' .. tier .. ':' .. slot end
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
)

# After COMMON in the scripts that read the live workers (LIVE, the lookups, SPARES):
# live_registrations() -> wids, slots (numbers), records ("slot:epoch"), heartbeat payloads
# of every current registration with a heartbeat, in the registry's order (one HGETALL and
# one MGET).
LIVE_REGISTRATIONS = r"""
local function live_registrations()
  local regs = redis.call('HGETALL', KEYS[1])
  local hbkeys = {}
  for i = 1, #regs, 2 do
    hbkeys[#hbkeys + 1] = ns .. 'hb:' .. string.match(regs[i + 1], '^(%d+):')
  end
  local wids, slots, recs, beats = {}, {}, {}, {}
  if #hbkeys == 0 then return wids, slots, recs, beats end
  local hb = redis.call('MGET', unpack(hbkeys))
  for i = 1, #hbkeys do
    if hb[i] then
      local rec = regs[2 * i]
      local k = #wids + 1
      wids[k], recs[k], beats[k] = regs[2 * i - 1], rec, hb[i]
      slots[k] = tonumber(string.match(rec, '^(%d+):'))
    end
  end
  return wids, slots, recs, beats
end
"""

# ARGV: worker_id, epoch, batch_seq, then (op, blob) pairs; op is "C" (clear every tier) or
# "S"/"R" (stored, removed) followed by a tier's value, e.g. "Sdevice"
# -> {0, added, removed} applied | {-1} stale epoch | {-2} duplicate | {-3, last} gap
APPLY = (
    COMMON
    + r"""
local slot, epoch = current(ARGV[1])
if not slot or epoch ~= ARGV[2] then return {-1} end
local last = tonumber(redis.call('HGET', ns .. 'seq', slot) or '0')
local bseq = tonumber(ARGV[3])
if bseq <= last then return {-2} end
if bseq ~= last + 1 then return {-3, last} end
for a = 4, #ARGV, 2 do  -- checked before any write: a script is not rolled back
  local op = ARGV[a]
  if op ~= 'C' and not IS_TIER[sub(op, 2)] then
    return redis.error_reply('KVC_TIER unknown op or tier ' .. op)
  end
end
local s = slot_bytes(slot)
local added, removed = 0, 0
for a = 4, #ARGV, 2 do
  local op, blob = ARGV[a], ARGV[a + 1]
  local kind = sub(op, 1, 1)
  if kind == 'C' then
    for _, t in ipairs(TIERS) do
      local held = held_of(t, slot)
      removed = removed + drop(blk_of(t), held, redis.call('SMEMBERS', held), s)
    end
  else
    local t = sub(op, 2)
    local ks = split(blob, 0, #blob / 16)
    if kind == 'S' then
      added = added + store(blk_of(t), held_of(t, slot), ks, s, slot)
    else
      removed = removed + drop(blk_of(t), held_of(t, slot), ks, s)
    end
  end
end
redis.call('HSET', ns .. 'seq', slot, bseq)
return {0, added, removed}
"""
)

# ARGV: worker_id, epoch, batch_seq, then (tier, blob) pairs: every recorded key the worker
# holds in that tier; a tier not named holds none -> {0, added, removed} | {-1} stale epoch
RESYNC = (
    COMMON
    + r"""
local slot, epoch = current(ARGV[1])
if not slot or epoch ~= ARGV[2] then return {-1} end
local blobs = {}
for a = 4, #ARGV, 2 do
  if not IS_TIER[ARGV[a]] then return redis.error_reply('KVC_TIER unknown tier ' .. ARGV[a]) end
  blobs[ARGV[a]] = ARGV[a + 1]
end
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
for _, t in ipairs(TIERS) do replace(blk_of(t), held_of(t, slot), blobs[t] or '') end
redis.call('HSET', ns .. 'seq', slot, ARGV[3])
return {0, added, removed}
"""
)

# ARGV: worker_id, tier -> every key its current registration holds in that tier
HELD = (
    COMMON
    + r"""
local slot = current(ARGV[1])
if not slot or not IS_TIER[ARGV[2]] then return {} end
return redis.call('SMEMBERS', held_of(ARGV[2], slot))
"""
)
