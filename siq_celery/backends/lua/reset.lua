-- reset: a new life for the queue (new epoch; tickets and pause forgotten). The last start
-- is kept, so a reset never allows a burst; finished-task records are kept too.
-- Overwrites corrupt state (the way out of SIQCORRUPT).
-- KEYS[1]  the queue's state hash
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  interval in microseconds, or 0 to keep the stored one
-- ARGV[3]  the new epoch
-- Returns the state as siq_reply; error SIQNOTFOUND if there is no state and ARGV[2] = 0.
local now = siq_now(ARGV[1])
local interval = tonumber(ARGV[2])
local s = siq_load(KEYS[1])  -- corrupt state is replaced, not reported
local last_start = now
if s then
  last_start = s.last_start_us
  if interval <= 0 then interval = s.interval_us end
elseif interval <= 0 then
  return redis.error_reply('SIQNOTFOUND')  -- missing (or corrupt) state and no interval given
end
redis.call('DEL', KEYS[1])
s = siq_new(now, interval, ARGV[3])
s.last_start_us = last_start
s.anchor_us = now - interval  -- ticket 1 of the new life is due at once
siq_save(KEYS[1], s)
return siq_reply(s, now)
