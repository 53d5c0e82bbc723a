-- finish: record that a task finished, so a redelivered copy of it is not run again.
-- KEYS[1]  the queue's finished-task sorted set, siq:{<queue>}:finished (score: time)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  task id
-- ARGV[3]  retention in microseconds: older records are dropped
-- ARGV[4]  most records kept (oldest dropped first)
-- Returns the number of records kept.
local now = siq_now(ARGV[1])
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]) - 1)
local kept = redis.call('ZCARD', KEYS[1])
local most = tonumber(ARGV[4])
if kept > most then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, kept - most - 1)
  kept = most
end
return kept
