-- status: the queue's state, the store time and the count of finished-task records.
-- KEYS[1]  the queue's state hash
-- KEYS[2]  the queue's finished-task sorted set
-- KEYS[3], KEYS[4]  parked tasks not leased, and leased (sorted sets)
-- KEYS[5]  the queue's interval sources hash
-- KEYS[6]  the queue's counts (of refused starts, and siq_count_start's)
-- KEYS[7]  the queue's window (siq_units); KEYS[8]  its leases (siq_read_leases)
-- KEYS[9]  the messages of the tasks waiting in its fair lines (parked without a ticket)
-- KEYS[10]  its fair keys with waiting tasks (siq_fair: f.active)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- The interval and limits reported are the ones the next start will use (a node declaration
-- that expired since the last recomputation no longer counts: siq_follow_expiry); nothing is
-- written.
-- Returns siq_reply (with when the last start was authorized and when the last back-off
-- ends) followed by the finished and parked counts (the tasks waiting in fair lines
-- included), the duplicates refused, the reclaims, the cost units in the window ending
-- now, the live leases, when the window quota lets the head of the line and the last ticket
-- claimed start (each as a start of cost 1; 0: now, or no quota or backlog:
-- window.status_window), the fairness keys with tasks waiting and those tasks, the counts
-- hash (HGETALL, one nested array), then siq_sources_reply; or an empty array if no state.
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
local fair_tasks = 0  -- (EXISTS first: a queue without fair shares needs no new ACL grant to be read)
if redis.call('EXISTS', KEYS[9]) == 1 then fair_tasks = redis.call('HLEN', KEYS[9]) end
table.insert(reply, redis.call('ZCARD', KEYS[3]) + redis.call('ZCARD', KEYS[4]) + fair_tasks)
local refused = redis.call('HMGET', KEYS[6], 'duplicate', 'reclaim')
table.insert(reply, tonumber(refused[1]) or 0)
table.insert(reply, tonumber(refused[2]) or 0)
local u = siq_units_read(KEYS[7], KEYS[1], s, now)  -- the starts that left the window are hidden, not forgotten
local used, head, last = 0, 0, 0
if u then
  used, head = u.used, siq_window_slot(u, s.current + 1, 1)
  if s.ticket > s.current then last = siq_window_slot(u, s.ticket, 1) end
end
table.insert(reply, used)
local live = 0
if s.concurrency > 0 then live = redis.call('ZCOUNT', KEYS[8], now + 1, '+inf') end  -- expiry > now
table.insert(reply, live)
table.insert(reply, head)
table.insert(reply, last)
table.insert(reply, redis.call('ZCARD', KEYS[10]))
table.insert(reply, fair_tasks)
table.insert(reply, redis.call('HGETALL', KEYS[6]))
for _, v in ipairs(siq_sources_reply(src)) do table.insert(reply, v) end
return reply
