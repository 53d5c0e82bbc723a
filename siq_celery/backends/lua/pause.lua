-- pause: no ticket of the queue starts until resume.
-- KEYS[1]  the queue's state hash
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- Returns the state as siq_reply; error SIQNOTFOUND if the queue has no state.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return redis.error_reply('SIQNOTFOUND') end
s.paused = 1
siq_save(KEYS[1], s)
redis.call('PERSIST', KEYS[1])  -- a paused queue never expires (idle expiry)
return siq_reply(s, now)
