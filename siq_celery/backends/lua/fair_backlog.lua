-- fair_backlog: what waits in a queue's fair lines (Backend.fair_backlog): how many fairness
-- keys have tasks waiting, how many tasks, and the keys with the most waiting, each with its
-- weight. Read only, and O(log n + top) however many keys wait: siq status, siq top and the
-- exporter read it.
-- KEYS[1]  the queue's fair keys by tasks waiting (QueueKeys.fair_waiting: siq_fair's f.waiting)
-- KEYS[2]  their weights (f.weight)
-- KEYS[3]  the messages of the tasks waiting (f.messages: one field per task)
-- ARGV[1]  now (unused; every script takes it first)
-- ARGV[2]  most keys to list (0: the counts only)
-- Returns {keys waiting, tasks waiting, key1, waiting1, weight1, ...}: the ARGV[2] keys with
-- the most waiting, ties by the smaller key, in no set order (the caller sorts them).
-- Redis orders equal scores by member, so of the last ARGV[2] members those above the
-- lowest count listed are the ones; at that count, the first members make up the rest.
local top = tonumber(ARGV[2])
local reply = {redis.call('ZCARD', KEYS[1]), redis.call('HLEN', KEYS[3])}
if top < 1 or reply[1] == 0 then return reply end
local most = redis.call('ZRANGE', KEYS[1], -top, -1, 'WITHSCORES')  -- ascending: fewest first
local lowest = most[2]
local function add(key, waiting)
  table.insert(reply, key)
  table.insert(reply, waiting)
  table.insert(reply, redis.call('HGET', KEYS[2], key) or 0)
end
local listed = 0
for i = 1, #most, 2 do
  if tonumber(most[i + 1]) > tonumber(lowest) then
    add(most[i], most[i + 1])
    listed = listed + 1
  end
end
for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], lowest, lowest, 'LIMIT', 0, top - listed)) do
  add(key, lowest)
end
return reply
