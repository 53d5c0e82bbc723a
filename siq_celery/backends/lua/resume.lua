-- resume: the line continues ARGV[2] from now: ticket current+1 is due then (rate cap
-- kept). The grace lets waiters polling the paused queue come back before their slots.
-- KEYS[1]  the queue's state hash; KEYS[2..]  its other keys (QueueKeys.all); KEYS[7] (interval
--          sources) for siq_follow_expiry
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  grace in microseconds (>= 0)
-- ARGV[3]  idle expiry in microseconds (0: never; see siq_touch): counted again from here
-- Returns the state as siq_reply; error SIQNOTFOUND if the queue has no state, SIQNOINTERVAL
-- if it was paused before any declaration and has no limit known yet (declarations.py: no_limit_known).
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return redis.error_reply('SIQNOTFOUND') end
if s.paused == 1 then  -- resuming a running queue changes nothing
  siq_follow_expiry(KEYS[7], s, now)
  if s.interval_us <= 1 and s.quota == 0 and s.concurrency == 0 then return redis.error_reply('SIQNOINTERVAL') end
  s.paused = 0
  s.anchor_us = math.max(s.anchor_us, now + tonumber(ARGV[2]) - s.interval_us)
  siq_save(KEYS[1], s)
  siq_touch(KEYS, s, tonumber(ARGV[3]), now)  -- idle from here on, unless parked tasks pin it
end
return siq_reply(s, now)
