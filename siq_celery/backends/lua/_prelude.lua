-- Prepended to every siq_celery script when it is loaded (backends/redis.py).
-- Helpers: the store clock, and loading / checking / saving one queue's state hash.
--
-- Times are integer microseconds since the Unix epoch (they fit a Lua double exactly).
-- Numbers reach Redis through redis.call, which formats them with %.17g; never build a
-- number into a string with tostring() or '..' (Lua's own format keeps 14 digits).
-- State hash fields: epoch, interval_us, ticket, current, anchor_us, last_start_us, paused;
-- two that only the status shows (no decision reads them; absent means 0): started_us,
-- when the last start was authorized, and held_until_us, when the last back-off ends;
-- and two that may be missing (read as 0): until_us, when the earliest live node declaration
-- expires (the interval is recomputed then: siq_follow_expiry), and idle_us, the queue's
-- idle expiry (siq_touch), so that an operator's reset or override keeps it.

local function siq_now(arg)
  if arg ~= nil and arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local SIQ_NUMBERS = {'interval_us', 'ticket', 'current', 'anchor_us', 'last_start_us', 'paused'}

-- Returns (state, nil), (nil, nil) when the queue has no state, or (nil, error text)
-- when a field holds something siq_celery did not write.
local function siq_load(key)
  local raw = redis.call('HMGET', key, 'epoch', 'interval_us', 'ticket', 'current',
                         'anchor_us', 'last_start_us', 'paused', 'started_us', 'held_until_us',
                         'until_us', 'idle_us')
  local present = false
  for i = 1, 7 do
    if raw[i] then present = true end
  end
  if not present then return nil, nil end
  if not raw[1] or raw[1] == '' then
    return nil, 'SIQCORRUPT epoch ' .. tostring(raw[1])
  end
  local s = {epoch = raw[1]}
  for i, name in ipairs(SIQ_NUMBERS) do
    local v = tonumber(raw[i + 1])
    if v == nil or v ~= math.floor(v) then
      return nil, 'SIQCORRUPT ' .. name .. ' ' .. tostring(raw[i + 1])
    end
    s[name] = v
  end
  if s.interval_us <= 0 then return nil, 'SIQCORRUPT interval_us ' .. raw[2] end
  if s.paused ~= 0 and s.paused ~= 1 then return nil, 'SIQCORRUPT paused ' .. raw[7] end
  s.started_us = tonumber(raw[8]) or 0
  s.held_until_us = tonumber(raw[9]) or 0
  s.until_us, s.idle_us = tonumber(raw[10]) or 0, tonumber(raw[11]) or 0
  return s, nil
end

-- A state created from nothing waits one interval before its first start: it cannot
-- know when the last start was, and that is the price of never bursting after a loss.
local function siq_new(now, interval, epoch)
  return {epoch = epoch, interval_us = interval, ticket = 0, current = 0,
          anchor_us = now, last_start_us = now, paused = 0, started_us = 0, held_until_us = 0,
          until_us = 0, idle_us = 0}
end

local function siq_save(key, s)
  redis.call('HSET', key, 'epoch', s.epoch, 'interval_us', s.interval_us, 'ticket', s.ticket,
             'current', s.current, 'anchor_us', s.anchor_us, 'last_start_us', s.last_start_us,
             'paused', s.paused, 'started_us', s.started_us, 'held_until_us', s.held_until_us,
             'until_us', s.until_us, 'idle_us', s.idle_us)
end

-- The flat reply shared by the control scripts: state fields, the store time, then the
-- times only the status shows.
local function siq_reply(s, now)
  return {s.epoch, s.interval_us, s.ticket, s.current, s.anchor_us, s.last_start_us,
          s.paused, now, s.started_us, s.held_until_us}
end

-- After an outage (no start, head overdue by more than max(10 intervals, 1 s), or than
-- overdue if longer: a release passes its horizon) the backlog shifts once so the head is
-- due max(10 intervals, 1 s) from now (model.py: shift_after_outage).
local function siq_shift_after_outage(s, now, overdue)
  local settle = math.max(10 * s.interval_us, 1000000)
  if s.anchor_us > s.last_start_us + s.interval_us then return false end  -- shifted already
  if s.anchor_us + s.interval_us >= now - math.max(settle, overdue) then return false end
  s.anchor_us = now + settle - s.interval_us
  return true
end

-- Idle expiry (per-key queues): every key of the queue expires ttl_us after the queue's
-- last claim, start or finish, unless it is paused or holds parked tasks (those outlive
-- any idle time). keys: the queue's keys in QueueKeys.all order (state, finished, ledger,
-- parked, parked messages, releasing, intervals). ttl_us <= 0: keys never expire. now: the store time.
-- The idle time is kept in the state (idle_us), so a script whose caller does not know it
-- (an operator's reset or override) passes 0 and the queue's own is used.
local function siq_touch(keys, s, ttl_us, now)
  if (not ttl_us or ttl_us <= 0) and s ~= nil then ttl_us = s.idle_us end
  if not ttl_us or ttl_us <= 0 then return end
  if s ~= nil and s.idle_us ~= ttl_us then
    s.idle_us = ttl_us
    redis.call('HSET', keys[1], 'idle_us', ttl_us)
  end
  local pin = (s ~= nil and s.paused == 1)
    or redis.call('EXISTS', keys[4]) == 1 or redis.call('EXISTS', keys[6]) == 1
  -- Idle means after the queue's last commitment: the last issued ticket's slot, a cost's
  -- or a back-off's hold. Keys that vanished before it would let a new life start early.
  local keep = ttl_us
  if s ~= nil then
    local busy = math.max(s.last_start_us + s.interval_us,
                          s.anchor_us + math.max(s.ticket - s.current, 0) * s.interval_us)
    keep = math.max(keep, busy - now + ttl_us)
  end
  for i = 1, #keys do
    if pin then
      redis.call('PERSIST', keys[i])
    else
      redis.call('PEXPIRE', keys[i], math.max(math.floor(keep / 1000), 1))
    end
  end
end

-- May ticket start now (model.decide; ticket 0 is FREE: no place in the line, the next
-- free slot)? Returns verdict, wait_us, slot_us; the state is
-- saved if the line shifted after an outage (that repair is due whatever the answer).
-- With 'paused', wait_us is the ticket's distance behind the head of the line.
local function siq_decide(key, s, ticket, epoch, cost, now)
  if ticket == 0 then  -- FREE: no place in this queue's line; the next free slot
    if s.paused == 1 then return 'paused', 0, 0 end
    local cap = s.last_start_us + s.interval_us
    if now < cap then return 'wait', cap - now, cap end
    return 'authorized', 0, cap
  end
  if epoch ~= s.epoch or ticket < 1 or ticket + cost - 1 > s.ticket or ticket ~= math.floor(ticket) then
    return 'reclaim', 0, 0
  end
  if s.paused == 1 then
    return 'paused', math.max(ticket - s.current - 1, 0) * s.interval_us, 0
  end
  if ticket > s.current and siq_shift_after_outage(s, now, 0) then siq_save(key, s) end
  local due = 0  -- a ticket passed over by current takes the next free slot
  if ticket > s.current then due = s.anchor_us + (ticket - s.current) * s.interval_us end
  local slot = math.max(due, s.last_start_us + s.interval_us)
  if now < slot then return 'wait', slot - now, slot end
  return 'authorized', 0, slot
end

-- Record an authorized start (model.commit_start): the line continues from it (a late
-- ticket takes the slot current+1 was due at, and the line behind shifts one slot; a line
-- due later stays where it is); a start of cost c is recorded as if its last slot were
-- used c - 1 intervals from now.
local function siq_commit(key, s, ticket, cost, now)
  if ticket > 0 and ticket + cost - 1 > s.current then s.current = ticket + cost - 1 end
  s.started_us = now  -- what the status shows; the cap counts from the last slot used
  s.last_start_us = now + (cost - 1) * s.interval_us
  s.anchor_us = math.max(s.anchor_us, s.last_start_us)
  siq_save(key, s)
end

-- A start in the ledger stream (e=s). Short field names: a stream keeps them per entry.
-- c: the start's cost (an entry written before it was recorded reads as 1).
local function siq_ledger_start(key, cap, s, ticket, task_id, slot, now, name, host, pid, deferrals, cost)
  if cap > 0 then
    redis.call('XADD', key, 'MAXLEN', '~', cap, '*', 'e', 's', 'ep', s.epoch, 't', ticket, 'id', task_id,
      'n', name, 'sl', slot, 'st', now, 'iv', s.interval_us, 'h', host, 'p', pid, 'd', deferrals, 'c', cost)
  end
end

-- Starts without a finish, per task id (model.py: too_many_lost): a sorted set of task
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

-- The counters of authorized starts (model.start_counts), in the queue's counts hash
-- (QueueKeys.refused, beside the counts of refused starts), in the start's own script:
-- starts, deferrals, gaps (closer than the interval less 1 ms to the last start counted,
-- kept in last_us), late_us (lateness against the slot, summed) and late:<i>, the starts
-- in lateness bucket i (0-based; #SIQ_LATENESS_BUCKETS: past the last bound).
local SIQ_LATENESS_BUCKETS = {500, 1000, 2000, 5000, 10000, 25000, 50000, 100000, 250000, 500000,
                              1000000, 2500000, 5000000, 10000000}  -- model.LATENESS_BUCKETS_US

local function siq_count_start(key, now, slot, interval, deferrals)
  local late = math.max(0, now - slot)
  local bucket = #SIQ_LATENESS_BUCKETS
  for i, bound in ipairs(SIQ_LATENESS_BUCKETS) do
    if late <= bound then bucket = i - 1; break end
  end
  local last = tonumber(redis.call('HGET', key, 'last_us'))
  redis.call('HINCRBY', key, 'starts', 1)
  redis.call('HINCRBY', key, 'late_us', late)
  redis.call('HINCRBY', key, 'late:' .. bucket, 1)
  if deferrals > 0 then redis.call('HINCRBY', key, 'deferrals', deferrals) end
  if last and now - last < interval - 1000 then redis.call('HINCRBY', key, 'gaps', 1) end
  redis.call('HSET', key, 'last_us', now)
end

-- Where the interval comes from (model.py: declare, override, effective_interval): a hash
-- with declared_us, declared_by, declared_at_us, override_us, override_by, override_at_us,
-- and per live worker node 'n:<node>' (its declared interval) and 'e:<node>' (when its
-- declaration expires unless renewed). Returns the fields as a table, nodes in .nodes
-- (node -> {interval, expires}), dropping expired nodes from the table (and, with
-- prune, from the hash). A field that holds no whole number where one belongs reads as 0
-- (a node's: the node is dropped); each is listed in .unreadable as 'field value', for the
-- caller's log (the next save of the sources drops it).
local function siq_sources(key, now, prune)
  local raw = redis.call('HGETALL', key)
  local src = {declared_us = 0, declared_by = '', declared_at_us = 0,
               override_us = 0, override_by = '', override_at_us = 0, nodes = {}, unreadable = {}}
  local intervals, expires = {}, {}
  for i = 1, #raw, 2 do
    local f, v = raw[i], raw[i + 1]
    local kind, node = string.sub(f, 1, 2), string.sub(f, 3)
    if f == 'declared_by' or f == 'override_by' then
      src[f] = v
    else
      local number = tonumber(v)
      if number == nil or number ~= math.floor(number) or number < 0 then
        table.insert(src.unreadable, f .. ' ' .. v)
        number = 0
      end
      if kind == 'n:' then intervals[node] = number
      elseif kind == 'e:' then expires[node] = number
      else src[f] = number end
    end
  end
  for node, interval in pairs(intervals) do
    local e = expires[node]
    if interval > 0 and e and e > now then
      src.nodes[node] = {interval, e}
    elseif prune then
      redis.call('HDEL', key, 'n:' .. node, 'e:' .. node)
    end
  end
  if prune then  -- an expiry left without its interval
    for node, _ in pairs(expires) do
      if not intervals[node] then redis.call('HDEL', key, 'e:' .. node) end
    end
  end
  return src
end

-- The override if set, else the slowest live declaration, else the last declaration;
-- 0 if none (the stored interval stays).
local function siq_effective(src)
  if src.override_us > 0 then return src.override_us end
  local slowest = 0
  for _, d in pairs(src.nodes) do
    if d[1] > slowest then slowest = d[1] end
  end
  if slowest > 0 then return slowest end
  return src.declared_us
end

-- When the earliest live node declaration expires (0: none live): the effective interval
-- may change then without any script declaring (siq_follow_expiry).
local function siq_until(src)
  local soonest = 0
  for _, d in pairs(src.nodes) do
    if soonest == 0 or d[2] < soonest then soonest = d[2] end
  end
  return soonest
end

-- The effective interval follows the expiry of node declarations (model.py: follow_expiry):
-- once the earliest live declaration seen at the last recomputation (s.until_us) has
-- expired, the interval is recomputed from those still live. Every script that decides by
-- the interval calls it first, so a killed node's declaration stops counting exactly
-- siq_declaration_ttl after its last renewal, on the store's clock, whether or not a live
-- node declares in between. True if s changed (the caller saves it).
local function siq_follow_expiry(sources_key, s, now)
  if s.until_us == 0 or now < s.until_us then return false end
  local src = siq_sources(sources_key, now, true)
  local effective = siq_effective(src)
  if effective > 0 then s.interval_us = effective end
  s.until_us = siq_until(src)
  return true
end

local function siq_save_sources(key, src)
  redis.call('HSET', key, 'declared_us', src.declared_us, 'declared_by', src.declared_by,
             'declared_at_us', src.declared_at_us, 'override_us', src.override_us,
             'override_by', src.override_by, 'override_at_us', src.override_at_us)
end

-- The sources as a flat reply: the six fields, then node, interval, expires per live node.
local function siq_sources_reply(src)
  local reply = {src.declared_us, src.declared_by, src.declared_at_us, src.override_us,
                 src.override_by, src.override_at_us}
  for node, d in pairs(src.nodes) do
    table.insert(reply, node)
    table.insert(reply, d[1])
    table.insert(reply, d[2])
  end
  return reply
end
