-- set_interval: an operator's override of the queue's interval (it applies from the next
-- start and holds across worker restarts that do not change the code's declaration), or
-- clearing it: back to what the code declares (model.py: override).
-- KEYS[1]  the queue's state hash
-- KEYS[2]  the queue's interval sources hash (see siq_sources)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  the override in microseconds (> 0), or 0 to clear it
-- ARGV[3]  origin, for people: who set it (user, host, pid)
-- Returns the state as siq_reply; error SIQNOTFOUND if the queue has no state.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return redis.error_reply('SIQNOTFOUND') end
local src = siq_sources(KEYS[2], now, true)
local interval = tonumber(ARGV[2])
if interval > 0 then
  src.override_us, src.override_by, src.override_at_us = interval, ARGV[3], now
else
  src.override_us, src.override_by, src.override_at_us = 0, '', 0
end
siq_save_sources(KEYS[2], src)
local effective = siq_effective(src)
if effective > 0 then s.interval_us = effective end
siq_save(KEYS[1], s)
return siq_reply(s, now)
