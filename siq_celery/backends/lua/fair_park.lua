-- fair_park: tasks of one fairness key wait in the key's line of a fair queue, with no
-- ticket (fair.fair_push; Backend.fair_park). The state is created if missing, as a claim
-- creates it; a release hands the heads tickets in fair order (siq_fair_promote).
-- KEYS[1..12]  the queue's keys (QueueKeys.all), all of them for idle expiry (siq_touch: the
--              waiting tasks pin them): KEYS[1] its state hash (the virtual time: fair_v);
--              KEYS[7] its interval sources (siq_follow_expiry); KEYS[10] its window
--              (emptied for a state created here); KEYS[12] its fair keys with waiting tasks
-- KEYS[13..16]  its finish tags, weights, waiting messages and keys by tasks waiting
--               (QueueKeys.fair_keys: siq_fair)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  interval in microseconds for a state created here; 0 = do not create
-- ARGV[3]  epoch for a state created here
-- ARGV[4]  idle expiry in microseconds (0: never; see siq_touch)
-- ARGV[5..9]  burst, quota, window (microseconds), concurrency, margin for a state created here
-- ARGV[10]  the fairness key
-- ARGV[11]  its weight, 1..MAX_FAIR_WEIGHT (from now on)
-- ARGV[12..]  triples: task id, cost (>= 1), message (JSON); a task id already waiting is
--             skipped (a publish sent again waits once), and so is one still parked under
--             a ticket (KEYS[5]: a retry whose last run's releaser has not yet unparked it,
--             which would drop it): its id is returned, for the caller to send it later
-- Returns {the number of tasks that joined the line, the ids still parked...}.
-- Errors (nothing written): SIQNOTFOUND (no state and ARGV[2] = 0), SIQCORRUPT <field>
-- <value>, SIQFAIR (a weight or a cost out of range; the caller checks them first).
local now = siq_now(ARGV[1])
local weight = siq_whole(ARGV[11], SIQ_MAX_FAIR_WEIGHT)
if not weight then return redis.error_reply('SIQFAIR weight ' .. ARGV[11]) end
for i = 12, #ARGV, 3 do
  if not siq_whole(ARGV[i + 1]) then return redis.error_reply('SIQFAIR cost ' .. ARGV[i + 1]) end
end
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then
  if tonumber(ARGV[2]) <= 0 then return redis.error_reply('SIQNOTFOUND') end
  s = siq_new(now, tonumber(ARGV[2]), ARGV[3], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9])
  siq_new_window(KEYS[10])
  siq_save(KEYS[1], s)
elseif siq_follow_expiry(KEYS[7], s, now) then
  siq_save(KEYS[1], s)
end
local f = siq_fair(KEYS[1], {KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16]})
local reply = {0}
for i = 12, #ARGV, 3 do
  if redis.call('HEXISTS', KEYS[5], ARGV[i]) == 1 then
    table.insert(reply, ARGV[i])
  elseif redis.call('HEXISTS', f.messages, ARGV[i]) == 0 then
    siq_fair_push(f, ARGV[10], ARGV[i], tonumber(ARGV[i + 1]), weight)
    redis.call('HSET', f.messages, ARGV[i], ARGV[i + 2])
    reply[1] = reply[1] + 1
  end
end
siq_touch({unpack(KEYS, 1, 12)}, s, tonumber(ARGV[4]), now)  -- pinned while tasks wait
return reply
