-- pause: no ticket of the queue starts until resume. A queue with no state yet (paused
-- before any worker, to prepare a deploy) is created paused with no interval known: no
-- spacing and no limits until the first declaration (tickets.py: paused_new_state).
-- KEYS[1]  the queue's state hash; KEYS[2..]  its other keys (QueueKeys.all; KEYS[10] its window)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  epoch for a state created here
-- Returns the state as siq_reply.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then
  s = siq_new(now, 1, ARGV[2], 0, 0, 0, 0)  -- 1: NO_SPACING_US
  siq_new_window(KEYS[10])
end
s.paused = 1
siq_save(KEYS[1], s)
-- A paused queue never expires (idle expiry), nor anything it needs when it resumes: its
-- finished ids (a redelivered copy must still be skipped), its ledger, its parked tasks.
for i = 1, #KEYS do redis.call('PERSIST', KEYS[i]) end
return siq_reply(s, now)
