-- claim: issue ARGV[2] consecutive tickets of one queue.
-- KEYS[1..12]  the queue's keys (QueueKeys.all), all of them for idle expiry (siq_touch):
--              KEYS[1] its state hash, siq:{<queue>}:state; KEYS[7] its interval sources
--              (siq_follow_expiry); KEYS[10] its window (siq_units: emptied for a state
--              created here); KEYS[11] its leases (the keys outlive the bodies still running)
-- ARGV[1]  now in microseconds, or '' for Redis TIME (tests pin the clock)
-- ARGV[2]  count of tickets, whole number >= 1
-- ARGV[3]  interval in microseconds for a state created here; 0 = do not create
-- ARGV[4]  epoch for a state created here
-- ARGV[5]  idle expiry in microseconds (0: never; see siq_touch)
-- ARGV[6..10]  burst, quota, window (microseconds), concurrency, margin for a state created here
-- Returns {first, count, epoch, base_us, floor_us, interval_us, now_us}: ticket n is
-- estimated to start at max(base_us + (n - first) * interval_us, floor_us); then, when the
-- window quota binds any of them, one window slot per ticket (ClaimResult.window_us).
-- Errors: SIQNOTFOUND (no state and ARGV[3] = 0), SIQCORRUPT <field> <value>.
local now = siq_now(ARGV[1])
local count = tonumber(ARGV[2])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then
  if tonumber(ARGV[3]) <= 0 then return redis.error_reply('SIQNOTFOUND') end
  s = siq_new(now, tonumber(ARGV[3]), ARGV[4], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10])
  siq_new_window(KEYS[10])
else
  siq_follow_expiry(KEYS[7], s, now)  -- saved below
end
local u = siq_units(KEYS[10], KEYS[1], s, now)  -- first: it may move the line
local first, due, floor = siq_claim(s, count, now)
local reply = {first, count, s.epoch, due, floor, s.interval_us, now}
if u then
  local slots, bound = {}, false
  for t = first, first + count - 1 do
    slots[#slots + 1] = siq_window_slot(u, t, 1)
    if slots[#slots] > 0 then bound = true end
  end
  if bound then
    for _, v in ipairs(slots) do reply[#reply + 1] = v end
  end
end
siq_save(KEYS[1], s)
siq_touch(KEYS, s, tonumber(ARGV[5]), now)
return reply
