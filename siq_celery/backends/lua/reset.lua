-- reset: a new life for the queue (new epoch; tickets and pause forgotten). The last start
-- is kept, so a reset never allows a burst; finished-task records are kept too.
-- Overwrites corrupt state (the way out of SIQCORRUPT).
-- KEYS[1]  the queue's state hash
-- KEYS[2..4]  parked tasks not leased, parked messages, leased tasks: parked tasks are
--             numbered 1..n in their order, so they keep their place in the new life
-- KEYS[5]  the queue's interval sources hash: a given interval is pinned (model.py: pin)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  interval in microseconds, or 0 to keep the stored one
-- ARGV[3]  the new epoch
-- ARGV[4]  origin, for people: who reset it with that interval
-- Returns the state as siq_reply; error SIQNOTFOUND if there is no state and ARGV[2] = 0.
local now = siq_now(ARGV[1])
local interval = tonumber(ARGV[2])
local s = siq_load(KEYS[1])  -- corrupt state is replaced, not reported
local last_start, started, held = now, 0, 0
if s then
  last_start, started, held = s.last_start_us, s.started_us, s.held_until_us
  if interval <= 0 then interval = s.interval_us end
elseif interval <= 0 then
  return redis.error_reply('SIQNOTFOUND')  -- missing (or corrupt) state and no interval given
end
redis.call('DEL', KEYS[1])
s = siq_new(now, interval, ARGV[3])
s.last_start_us = last_start
s.started_us, s.held_until_us = started, held  -- kept, as the last start is
s.anchor_us = now - interval  -- ticket 1 of the new life is due at once
local parked = {}
for _, key in ipairs({KEYS[2], KEYS[4]}) do
  for _, id in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    local v = redis.call('HGET', KEYS[3], id)
    if v then
      local bar = string.find(v, '|', 1, true)
      table.insert(parked, {tonumber(string.sub(v, 1, bar - 1)), id, string.sub(v, bar + 1)})
    end
  end
end
table.sort(parked, function(a, b) return a[1] < b[1] end)
redis.call('DEL', KEYS[2], KEYS[4])
for n, p in ipairs(parked) do
  redis.call('ZADD', KEYS[2], n, p[2])
  redis.call('HSET', KEYS[3], p[2], n .. '|' .. p[3])
end
s.ticket = #parked
if tonumber(ARGV[2]) > 0 then
  local src = siq_sources(KEYS[5], now, true)
  local live = false
  for _ in pairs(src.nodes) do live = true end
  if src.declared_us == 0 and not live then
    src.declared_us, src.declared_by, src.declared_at_us = interval, ARGV[4], now
  else
    src.override_us = 0
    if interval == siq_effective(src) then
      src.override_by, src.override_at_us = '', 0
    else
      src.override_us, src.override_by, src.override_at_us = interval, ARGV[4], now
    end
  end
  siq_save_sources(KEYS[5], src)
end
siq_save(KEYS[1], s)
return siq_reply(s, now)
