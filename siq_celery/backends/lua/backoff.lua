-- backoff: no start of the queue before now + ARGV[2] (the service said "retry after").
-- The last start and the anchor move so that the cap and ticket current+1 both fall
-- then; the line behind keeps its order. Never earlier than already due.
-- KEYS[1..12]  the queue's keys (QueueKeys.all), all of them for idle expiry (siq_touch):
--              KEYS[1] its state hash; KEYS[7] its interval sources (siq_follow_expiry)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  how long to hold, in microseconds (>= 0)
-- ARGV[3]  1: keep the first slot after the hold for the task that backed off (it comes
--          back with its passed-over ticket); the line follows one slot on
-- ARGV[4]  idle expiry in microseconds (0: never; see siq_touch)
-- Returns the state as siq_reply; error SIQNOTFOUND if the queue has no state.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return redis.error_reply('SIQNOTFOUND') end
siq_follow_expiry(KEYS[7], s, now)  -- saved below
local until_us = now + tonumber(ARGV[2]) - s.interval_us
s.held_until_us = math.max(s.held_until_us, now + tonumber(ARGV[2]))
s.last_start_us = math.max(s.last_start_us, until_us + s.burst * s.interval_us)  -- spends the burst credit
local keep = 0
if ARGV[3] == '1' then keep = s.interval_us end
s.anchor_us = math.max(s.anchor_us, until_us + keep)
siq_save(KEYS[1], s)
siq_touch(KEYS, s, tonumber(ARGV[4]), now)  -- the keys outlive the hold
return siq_reply(s, now)
