-- ensure: create a queue's state if it has none; never change existing state.
-- KEYS[1]  the queue's state hash
-- KEYS[2]  the queue's window (siq_units): emptied for a state created here
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  interval in microseconds
-- ARGV[3]  epoch for the new state
-- ARGV[4..8]  burst, quota, window (microseconds), concurrency, margin for the new state
-- Returns {created (0|1)} followed by siq_reply (the state, now, the status-only times, the
-- limits: 14 values).
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
local created = 0
if not s then
  s = siq_new(now, tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8])
  siq_new_window(KEYS[2])
  siq_save(KEYS[1], s)
  created = 1
end
local reply = siq_reply(s, now)
table.insert(reply, 1, created)
return reply
