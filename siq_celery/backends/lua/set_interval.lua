-- set_interval: an operator's override of the queue's interval (it applies from the next
-- start and holds across worker restarts that do not change the code's declaration), or
-- clearing it: back to what the code declares (declarations.py: override).
-- KEYS[1..12]  the queue's keys (QueueKeys.all): KEYS[1] its state hash, KEYS[7] its interval
--              sources hash (see siq_sources); all of them for idle expiry (siq_touch, which
--              also reads KEYS[4], KEYS[6], KEYS[11] and KEYS[12]: parked, leased parked, leases, fair)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  the override in microseconds (> 0), or 0 to clear it
-- ARGV[3]  origin, for people: who set it (user, host, pid)
-- ARGV[4]  idle expiry in microseconds, or 0: the queue's own (an operator's command does
--          not know it; a per-key queue keeps expiring when idle: siq_touch)
-- Returns the state as siq_reply, then each unreadable field of the sources as 'field value'
-- (dropped here: siq_sources); error SIQNOTFOUND if the queue has no state.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return redis.error_reply('SIQNOTFOUND') end
local src = siq_sources(KEYS[7], now, true)
local interval = tonumber(ARGV[2])
if interval > 0 then
  src.override_us, src.override_by, src.override_at_us = interval, ARGV[3], now
else
  src.override_us, src.override_by, src.override_at_us = 0, '', 0
end
return siq_commit_override(KEYS, s, src, tonumber(ARGV[4]), now)
