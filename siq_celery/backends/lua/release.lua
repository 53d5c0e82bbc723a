-- release: lease to the caller the parked tasks whose slot is within the horizon, and any
-- whose lease expired (their releaser died before publishing them). Atomic: two callers
-- never get the same task unless the first one's lease ran out.
-- KEYS[1]  the queue's state hash
-- KEYS[2]  parked tasks not leased: sorted set, score = ticket
-- KEYS[3]  parked messages: hash, task id -> '<ticket>|<message>'
-- KEYS[4]  leased tasks: sorted set, score = lease deadline (us)
-- KEYS[5]  the queue's interval sources hash (siq_follow_expiry)
-- KEYS[6]  the queue's window (siq_units): a ticket is due by the later of its interval
--          slot and its window slot, as a start of cost 1
-- KEYS[7..11]  the queue's fair keys (QueueKeys.fair_keys: siq_fair): first, the heads of
--          its fair lines are handed tickets, a lookahead at a time (siq_fair_promote), and
--          parked under them with their messages, each with its fair share in front
--          (siq_fair_message: key, tag and weight, for the ledger)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  horizon in microseconds
-- ARGV[3]  most tasks to hand out
-- ARGV[4]  lease in microseconds
-- Returns {epoch, now, id1, ticket1, estimate1, message1, ...}; {'', now} without state.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return {'', now} end
if siq_follow_expiry(KEYS[5], s, now) then siq_save(KEYS[1], s) end
local limit = tonumber(ARGV[3])
local lease_until = now + tonumber(ARGV[4])
local reply = {s.epoch, now}
local expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now, 'LIMIT', 0, limit)
-- After an outage longer than the horizon the line restarts from now; a shorter one is
-- left to the first task that comes back (tickets.py: release_cutoff).
if s.paused == 0 then
  local held = siq_window_slot(siq_units(KEYS[6], KEYS[1], s, now), s.current + 1, 1)
  if siq_shift_after_outage(s, now, tonumber(ARGV[2]), held) then siq_save(KEYS[1], s) end
end
local promoted = siq_fair_promote(siq_fair(KEYS[1], {KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]}), s, now)
if #promoted > 0 then
  for _, p in ipairs(promoted) do  -- parked under their tickets (as park.lua keeps them)
    local message = redis.call('HGET', KEYS[10], p[2])
    redis.call('HDEL', KEYS[10], p[2])
    redis.call('ZADD', KEYS[2], p[1], p[2])
    message = siq_fair_message(message or '', p[3], p[4], p[5])
    redis.call('HSET', KEYS[3], p[2], string.format('%d|%s', p[1], message))
  end
  siq_save(KEYS[1], s)
end
local u = siq_units(KEYS[6], KEYS[1], s, now)  -- read again: the line may have shifted
local due = {}
-- Nothing is due while paused, or while the next free slot (the cap, or the window's) is
-- itself beyond the horizon (a long back-off): no ticket, passed-over ones included,
-- starts before it.
local reach = now + tonumber(ARGV[2])
local in_reach = siq_cap(s) <= reach and siq_window_slot(u, 0, 1) <= reach
if s.paused == 0 and in_reach and #expired < limit then
  local ahead = math.floor((reach - s.anchor_us) / s.interval_us)
  local cutoff = s.current + math.max(ahead, 0)
  if u and cutoff > s.current then  -- the window slots grow with the ticket: the last one in reach
    local low, high = s.current, cutoff
    while low < high do
      local mid = math.floor((low + high + 1) / 2)
      if siq_window_slot(u, mid, 1) <= reach then low = mid else high = mid - 1 end
    end
    cutoff = low
  end
  due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff, 'LIMIT', 0, limit - #expired)
end
local function hand_out(id)
  local v = redis.call('HGET', KEYS[3], id)
  redis.call('ZREM', KEYS[2], id)
  if not v then
    redis.call('ZREM', KEYS[4], id)
    return
  end
  local bar = string.find(v, '|', 1, true)
  local ticket = tonumber(string.sub(v, 1, bar - 1))
  local slot = math.max(siq_cap(s), siq_window_slot(u, ticket, 1))
  if ticket > s.current then slot = math.max(s.anchor_us + (ticket - s.current) * s.interval_us, slot) end
  redis.call('ZADD', KEYS[4], lease_until, id)
  table.insert(reply, id)
  table.insert(reply, ticket)
  table.insert(reply, math.max(slot, now))
  table.insert(reply, string.sub(v, bar + 1))
end
for _, id in ipairs(expired) do hand_out(id) end
for _, id in ipairs(due) do hand_out(id) end
return reply
