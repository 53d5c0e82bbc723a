-- set_interval: change the queue's interval; it applies from the next start.
-- KEYS[1]  the queue's state hash
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  the new interval in microseconds (> 0)
-- Returns the state as siq_reply; error SIQNOTFOUND if the queue has no state.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return redis.error_reply('SIQNOTFOUND') end
s.interval_us = tonumber(ARGV[2])
siq_save(KEYS[1], s)
return siq_reply(s, now)
