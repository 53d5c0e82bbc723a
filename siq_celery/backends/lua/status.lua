-- status: the queue's state, the store time and the count of finished-task records.
-- KEYS[1]  the queue's state hash
-- KEYS[2]  the queue's finished-task sorted set
-- KEYS[3], KEYS[4]  parked tasks not leased, and leased (sorted sets)
-- KEYS[5]  the queue's interval sources hash
-- KEYS[6]  the queue's counts (of refused starts, and siq_count_start's)
-- KEYS[7]  the queue's window (siq_units); KEYS[8]  its leases (siq_read_leases)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- The interval and limits reported are the ones the next start will use (a node declaration
-- that expired since the last recomputation no longer counts: siq_follow_expiry); nothing is
-- written.
-- Returns siq_reply (with when the last start was authorized and when the last back-off
-- ends) followed by the finished and parked counts, the duplicates refused, the
-- reclaims, the cost units in the window ending now, the live leases, the counts hash (HGETALL, one nested
-- array), then siq_sources_reply;
-- or an empty array if no state.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return {} end
local src = siq_sources(KEYS[5], now, false)
if s.until_us > 0 and now >= s.until_us then  -- as siq_follow_expiry will have it (read only here)
  siq_apply_sources(src, s)
end
local reply = siq_reply(s, now)
table.insert(reply, redis.call('ZCARD', KEYS[2]))
table.insert(reply, redis.call('ZCARD', KEYS[3]) + redis.call('ZCARD', KEYS[4]))
local refused = redis.call('HMGET', KEYS[6], 'duplicate', 'reclaim')
table.insert(reply, tonumber(refused[1]) or 0)
table.insert(reply, tonumber(refused[2]) or 0)
local used = s.w_used
if redis.call('ZCARD', KEYS[7]) == 0 then used = 0 end  -- its starts expired (siq_units)
if s.quota > 0 then  -- the starts that left the window, not yet forgotten
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now - s.window_us)) do
    used = used - siq_member_cost(member)
  end
end
table.insert(reply, math.max(used, 0))
local live = 0
if s.concurrency > 0 then live = redis.call('ZCOUNT', KEYS[8], now + 1, '+inf') end  -- expiry > now
table.insert(reply, live)
table.insert(reply, redis.call('HGETALL', KEYS[6]))
for _, v in ipairs(siq_sources_reply(src)) do table.insert(reply, v) end
return reply
