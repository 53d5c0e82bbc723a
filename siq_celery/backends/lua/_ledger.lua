-- The Redis store's records of starts (part of the prelude: backends/redis_replies.py PRELUDE): a
-- start's entry in the queue's ledger stream, and per task id its starts without a finish
-- (whose count the start scripts check by concurrency.too_many_lost).
-- twin: siq_celery/ledger.py (reads the stream); the other stores keep both their own way

-- A start in the ledger stream (e=s). Short field names: a stream keeps them per entry.
-- c: the start's cost (an entry written before it was recorded reads as 1). The limits in
-- force (ledger.py, schema 3), each only when not 0: b burst, q quota, w window_us,
-- k concurrency; with a lease taken, lt its time to live and l its tag (siq_lease_tag); a
-- fair task's share (schema 4; fair = {key, tag, weight}, key '' none): fk, ft, fw.
local function siq_lease_tag(task_id, member)
  local prefix = task_id .. ':'
  if task_id ~= '' and string.sub(member, 1, #prefix) == prefix then return string.sub(member, #prefix + 1) end
  return member
end

local function siq_ledger_start(key, cap, s, ticket, task_id, slot, now, name, host, pid, deferrals, cost, lease,
                                lease_ttl, fair)
  if cap <= 0 then return end
  local entry = {'e', 's', 'ep', s.epoch, 't', ticket, 'id', task_id, 'n', name, 'sl', slot, 'st', now,
                 'iv', s.interval_us, 'h', host, 'p', pid, 'd', deferrals, 'c', cost}
  for _, f in ipairs({{'b', s.burst}, {'q', s.quota}, {'w', s.window_us}, {'k', s.concurrency}}) do
    if f[2] ~= 0 then
      table.insert(entry, f[1])
      table.insert(entry, f[2])
    end
  end
  if lease and lease ~= '' and s.concurrency > 0 then  -- a run's lease without a cap: not the audit's
    table.insert(entry, 'lt')
    table.insert(entry, lease_ttl)
    table.insert(entry, 'l')
    table.insert(entry, siq_lease_tag(task_id, lease))
  end
  if fair and fair[1] and fair[1] ~= '' then  -- a fair task: its key, tag and weight
    for i, name in ipairs({'fk', 'ft', 'fw'}) do
      table.insert(entry, name)
      table.insert(entry, fair[i])
    end
  end
  redis.call('XADD', key, 'MAXLEN', '~', cap, '*', unpack(entry))
end

-- Starts without a finish, per task id (concurrency.py: too_many_lost): a sorted set of task
-- ids, each scored with the time of its last authorized start (microseconds, rounded
-- down to the millisecond) plus the count (at most 999): one score both orders them by
-- age (trimmed like the finished records) and carries the count. A finish removes it.
local function siq_unfinished(key, task_id, now, retention)
  local score = tonumber(redis.call('ZSCORE', key, task_id))
  if not score or math.floor(score / 1000) * 1000 < now - retention then return 0 end
  return score % 1000
end

local function siq_count_unfinished(key, task_id, now, retention, most)
  local n = math.min(siq_unfinished(key, task_id, now, retention) + 1, 999)
  redis.call('ZADD', key, math.floor(now / 1000) * 1000 + n, task_id)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', math.floor((now - retention) / 1000) * 1000 - 1)
  local kept = redis.call('ZCARD', key)
  if kept > most then redis.call('ZREMRANGEBYRANK', key, 0, kept - most - 1) end
end
