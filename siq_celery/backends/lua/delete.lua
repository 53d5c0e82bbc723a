-- delete: forget every key of the queue, the line of each fairness key with waiting tasks
-- included (in one step: a task parked meanwhile cannot leave a line behind).
-- KEYS[1..12]  the queue's keys (QueueKeys.all); KEYS[12] its fair keys with waiting tasks
-- KEYS[13..16]  its other fair keys (QueueKeys.fair_keys)
-- ARGV[1]  now (unused; every script takes it first)
-- Returns the number of keys deleted.
local f = siq_fair(KEYS[1], {KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16]})
local deleted = 0
for _, key in ipairs(redis.call('ZRANGE', f.active, 0, -1)) do
  deleted = deleted + redis.call('DEL', siq_fair_line(f, key))
end
for i = 1, #KEYS do deleted = deleted + redis.call('DEL', KEYS[i]) end
return deleted
