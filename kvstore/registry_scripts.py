"""Lua scripts of the worker registry: register (a new epoch and a slot), heartbeat,
deregister, the live workers, and the purge of dead registrations' entries. Conventions: see
:mod:`kvstore.scripts`.
"""

from __future__ import annotations

from kvstore.scripts import COMMON, LIVE_REGISTRATIONS

# ARGV: worker_id, ttl_ms, heartbeat payload -> {epoch (text), slot} or error KVC_FULL
REGISTER = (
    COMMON
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
for _, t in ipairs(TIERS) do redis.call('DEL', held_of(t, slot)) end
redis.call('SET', ns .. 'hb:' .. slot, ARGV[3], 'PX', ARGV[2])
return {epoch, slot}
"""
)

# ARGV: worker_id, epoch, ttl_ms, payload -> 1 accepted, 0 stale
HEARTBEAT = (
    COMMON
    + r"""
local slot, epoch = current(ARGV[1])
if not slot or epoch ~= ARGV[2] then return 0 end
redis.call('SET', ns .. 'hb:' .. slot, ARGV[4], 'PX', ARGV[3])
return 1
"""
)

# ARGV: worker_id, epoch -> 1 deregistered, 0 stale. Entries are purged by purge_dead.
DEREGISTER = (
    COMMON
    + r"""
local slot, epoch = current(ARGV[1])
if not slot or epoch ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', ns .. 'hb:' .. slot)
return 1
"""
)

# -> {worker_id, "slot:epoch", heartbeat payload, ...} for every live worker
LIVE = (
    COMMON
    + LIVE_REGISTRATIONS
    + r"""
local wids, _, recs, beats = live_registrations()
local out = {}
for i = 1, #wids do
  out[#out + 1] = wids[i]; out[#out + 1] = recs[i]; out[#out + 1] = beats[i]
end
return out
"""
)

# ARGV: max registrations -> {slot, record, ...} of dead ones (superseded, deregistered, or
# without heartbeat; the latter are unregistered here so their worker must register again)
PURGE_SCAN = (
    COMMON
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
    COMMON
    + r"""
local slot, rec = ARGV[1], ARGV[2]
if redis.call('HGET', ns .. 'slots', slot) ~= rec then return -1 end
local wid = string.match(rec, '^%d+:(.*)$')
local cur = current(wid)
if cur and tostring(cur) == slot then return -1 end
local sb, chunk = slot_bytes(tonumber(slot)), tonumber(ARGV[3])
local left = 0
for _, t in ipairs(TIERS) do  -- tier by tier, fastest first, a chunk at a time
  local held = held_of(t, slot)
  drop(blk_of(t), held, redis.call('SPOP', held, chunk), sb)
  left = redis.call('SCARD', held)
  if left > 0 then break end
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
