-- claim: issue ARGV[2] consecutive tickets of one queue.
-- KEYS[1]  the queue's state hash, siq:{<queue>}:state
-- KEYS[2..8]  the queue's other keys (QueueKeys.all), for idle expiry; KEYS[7] (interval
--          sources) also for siq_follow_expiry
-- ARGV[1]  now in microseconds, or '' for Redis TIME (tests pin the clock)
-- ARGV[2]  count of tickets, whole number >= 1
-- ARGV[3]  interval in microseconds for a state created here; 0 = do not create
-- ARGV[4]  epoch for a state created here
-- ARGV[5]  idle expiry in microseconds (0: never; see siq_touch)
-- Returns {first, count, epoch, base_us, floor_us, interval_us, now_us}: ticket n is
-- estimated to start at max(base_us + (n - first) * interval_us, floor_us).
-- Errors: SIQNOTFOUND (no state and ARGV[3] = 0), SIQCORRUPT <field> <value>.
local now = siq_now(ARGV[1])
local count = tonumber(ARGV[2])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then
  if tonumber(ARGV[3]) <= 0 then return redis.error_reply('SIQNOTFOUND') end
  s = siq_new(now, tonumber(ARGV[3]), ARGV[4])
else
  siq_follow_expiry(KEYS[7], s, now)  -- saved below
end
local first = s.ticket + 1
local due = s.anchor_us + (first - s.current) * s.interval_us
local floor = math.max(now, s.last_start_us + s.interval_us)
if due < floor then
  -- The line is overdue (an idle queue), or its head is held by the rate cap: the new
  -- ticket is due at the first free slot and later claims follow one interval apart, so
  -- a burst of claims keeps its ticket order and every estimate matches its slot.
  s.anchor_us = s.anchor_us + (floor - due)
  due = floor
end
s.ticket = s.ticket + count
siq_save(KEYS[1], s)
siq_touch(KEYS, s, tonumber(ARGV[5]), now)
return {first, count, s.epoch, due, floor, s.interval_us, now}
