-- claim: issue ARGV[2] consecutive tickets of one queue.
-- KEYS[1]  the queue's state hash, siq:{<queue>}:state
-- KEYS[2..7]  the queue's other keys (QueueKeys.all), for idle expiry
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
end
local first = s.ticket + 1
local due = s.anchor_us + (first - s.current) * s.interval_us
if due < now then
  -- The whole line is overdue (an idle queue): the new ticket is due now, so a burst of
  -- claims keeps its ticket order.
  s.anchor_us = s.anchor_us + (now - due)
  due = now
end
s.ticket = s.ticket + count
siq_save(KEYS[1], s)
siq_touch(KEYS, s, tonumber(ARGV[5]), now)
return {first, count, s.epoch, due, math.max(now, s.last_start_us + s.interval_us),
        s.interval_us, now}
