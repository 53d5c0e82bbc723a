-- park: keep tasks whose slot is beyond the horizon in the store, ordered by ticket.
-- KEYS[1]  the queue's state hash
-- KEYS[2]  parked tasks not leased to a releaser: sorted set, score = ticket
-- KEYS[3]  parked messages: hash, task id -> '<ticket>|<message>'
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  the tickets' epoch
-- ARGV[3..] triples: ticket, task id, message (JSON)
-- Returns 1, or 0 (nothing kept) when the state is missing or of another epoch.
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s or s.epoch ~= ARGV[2] then return 0 end
redis.call('PERSIST', KEYS[1])  -- a queue with parked tasks never expires (idle expiry)
for i = 3, #ARGV, 3 do
  redis.call('ZADD', KEYS[2], tonumber(ARGV[i]), ARGV[i + 1])
  redis.call('HSET', KEYS[3], ARGV[i + 1], ARGV[i] .. '|' .. ARGV[i + 2])
end
return 1
