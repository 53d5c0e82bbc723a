-- pause: no ticket of the queue starts until resume.
-- KEYS[1]  the queue's state hash; KEYS[2..]  its other keys (QueueKeys.all)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- Returns the state as siq_reply; error SIQNOTFOUND if the queue has no state.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return redis.error_reply('SIQNOTFOUND') end
s.paused = 1
siq_save(KEYS[1], s)
-- A paused queue never expires (idle expiry), nor anything it needs when it resumes: its
-- finished ids (a redelivered copy must still be skipped), its ledger, its parked tasks.
for i = 1, #KEYS do redis.call('PERSIST', KEYS[i]) end
return siq_reply(s, now)
