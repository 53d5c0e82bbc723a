-- unpark: forget released tasks once their releaser has published them.
-- KEYS[1]  parked tasks not leased (sorted set)
-- KEYS[2]  parked messages (hash)
-- KEYS[3]  leased tasks (sorted set)
-- ARGV[1]  now (unused; every script takes it first)
-- ARGV[2..] task ids
for i = 2, #ARGV do
  redis.call('ZREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[2], ARGV[i])
  redis.call('ZREM', KEYS[3], ARGV[i])
end
return #ARGV - 1
