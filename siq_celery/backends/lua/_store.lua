-- The prelude of every siq_celery script is these files, in the order of backends/redis_replies.py
-- PRELUDE, prepended to the script when it is loaded: the Redis store's own plumbing here and
-- in _ledger.lua, then the rules of each limit kind, siq_celery/rules/<kind>.lua beside their
-- Python twins, the start decision combining them last (rules/line.lua).
-- This file: the store clock, loading / checking / saving one queue's state hash, the flat
-- replies (the state's, the sources'), the keys' idle expiry and the wake channel. No rule.
-- twin: siq_celery/backends/redis.py (STATE_REPLY, _sources: it reads these replies); the
-- memory and SQLite stores keep their state their own way (backends/memory.py, sqlite.py).
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
-- The limits beyond the interval (absent means 0; types.Limits): burst, quota and window_us, and
-- w_used, the cost units in the queue's window (a sorted set of starts: siq_units), w_cum
-- numbering its units (w_seq: an earlier version's numbering of its starts); conc, the concurrency cap (its leases: a sorted set, siq_read_leases).
-- fair_v (absent means 0): a fair queue's virtual time (siq_fair), kept by a reset.
-- margin (absent means 0; declarations.set_limits): the queue's margin, already added to interval_us
-- and (with a quota) to window_us, the spacing and window in force; siq_declared takes it out.
-- pend_us and pend_due (absent means 0): a start whose body has not reported that it began
-- (types.QueueState.pending_us, began.lua): until when later starts wait for it (minus its
-- authorization once it reported), and the last slot used before it plus the interval then.

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
                         'until_us', 'idle_us', 'burst', 'quota', 'window_us', 'w_used', 'conc', 'pend_us',
                         'pend_due', 'margin')
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
  s.burst, s.quota, s.window_us = tonumber(raw[12]) or 0, tonumber(raw[13]) or 0, tonumber(raw[14]) or 0
  s.w_used = tonumber(raw[15]) or 0
  s.concurrency = tonumber(raw[16]) or 0
  s.pending_us, s.pending_due_us = tonumber(raw[17]) or 0, tonumber(raw[18]) or 0
  s.margin_us = tonumber(raw[19]) or 0
  return s, nil
end

local function siq_save(key, s)
  redis.call('HSET', key, 'epoch', s.epoch, 'interval_us', s.interval_us, 'ticket', s.ticket,
             'current', s.current, 'anchor_us', s.anchor_us, 'last_start_us', s.last_start_us,
             'paused', s.paused, 'started_us', s.started_us, 'held_until_us', s.held_until_us,
             'until_us', s.until_us, 'idle_us', s.idle_us, 'burst', s.burst, 'quota', s.quota,
             'window_us', s.window_us, 'w_used', s.w_used, 'conc', s.concurrency, 'pend_us', s.pending_us,
             'pend_due', s.pending_due_us, 'margin', s.margin_us)
end

-- The flat reply shared by the control scripts: state fields, the store time, then the
-- times only the status shows, then the limits (15 values: redis.py STATE_REPLY).
local function siq_reply(s, now)
  return {s.epoch, s.interval_us, s.ticket, s.current, s.anchor_us, s.last_start_us,
          s.paused, now, s.started_us, s.held_until_us, s.burst, s.quota, s.window_us, s.concurrency,
          s.margin_us}
end

-- Idle expiry (per-key queues): every key in keys expires ttl_us after the queue's last
-- commitment (below), counted from now, unless it is paused or holds parked tasks, or tasks
-- waiting in its fair lines (those outlive any idle time: the keys are made persistent).
-- keys: the queue's keys, every one of which gets the expiry; read here are keys[1] the
-- state hash (idle_us is written there), keys[4] and keys[6] its parked tasks not leased and
-- leased (QueueKeys.all order: state, finished, ledger, parked, parked messages, releasing,
-- intervals, refused, unfinished, window, leases, fair) and, if given, keys[11] its leases
-- and keys[12] its fair keys with waiting tasks (siq_fair; the fair lines and the fair
-- shares' other keys never get an expiry, and each is gone once it is empty). s: the state
-- (nil: none or corrupt). ttl_us <= 0: the state's own idle_us; with none either, nothing expires.
-- now: the store time. The idle time is kept in the state (idle_us), so a script whose caller does
-- not know it (an operator's reset or override) passes 0 and the queue's own is used.
local function siq_touch(keys, s, ttl_us, now)
  if (not ttl_us or ttl_us <= 0) and s ~= nil then ttl_us = s.idle_us end
  if not ttl_us or ttl_us <= 0 then return end
  if s ~= nil and s.idle_us ~= ttl_us then
    s.idle_us = ttl_us
    redis.call('HSET', keys[1], 'idle_us', ttl_us)
  end
  local pin = (s ~= nil and s.paused == 1)
    or redis.call('EXISTS', keys[4]) == 1 or redis.call('EXISTS', keys[6]) == 1
    or (keys[12] ~= nil and redis.call('EXISTS', keys[12]) == 1)
  -- Idle means after the queue's last commitment: the last issued ticket's slot, a cost's
  -- or a back-off's hold. Keys that vanished before it would let a new life start early.
  local keep = ttl_us
  if s ~= nil then
    local busy = math.max(s.last_start_us + s.interval_us,
                          s.anchor_us + math.max(s.ticket - s.current, 0) * s.interval_us)
    if s.quota > 0 then busy = math.max(busy, s.started_us + s.window_us) end  -- the window's starts
    if keys[11] then  -- the leases: the keys outlive the bodies still running
      local last = redis.call('ZRANGE', keys[11], -1, -1, 'WITHSCORES')
      if #last > 0 then busy = math.max(busy, tonumber(last[2])) end
    end
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

-- Wake the queue's waiters (a lease given back under a cap): publish the next
-- ticket in line and the store's time on the queue's wake channel (keys.py: wake), which a
-- waiter holding that ticket or an earlier one reads (backends/redis.py: Wakes). A user
-- without the channel's permission (ACL) publishes nothing: its waiters poll, as before.
local function siq_wake(channel, s, now)
  if channel and channel ~= '' and s then
    redis.pcall('PUBLISH', channel, string.format('%.0f %.0f', s.current + 1, now))
  end
end

-- Limits as five reply values; -1 for each when there are none (nil).
local function siq_limits_reply(reply, l)
  if l then
    for _, v in ipairs({l.burst, l.quota, l.window_us, l.concurrency, l.margin_us}) do table.insert(reply, v) end
  else
    for _ = 1, 5 do table.insert(reply, -1) end
  end
end

-- The limits override as five reply values: each kind's, -1 for one not overridden (the
-- window: 0 then).
local function siq_override_reply(reply, o)
  table.insert(reply, o.burst or -1)
  table.insert(reply, o.quota or -1)
  table.insert(reply, o.window_us or 0)
  table.insert(reply, o.concurrency or -1)
  table.insert(reply, o.margin_us or -1)
end

-- The sources as a flat reply (redis.py: _sources): the six interval fields, the declared
-- limits (siq_limits_reply), the limits override (siq_override_reply), limits_by,
-- limits_at_us; then node, interval, expires and its five limits (siq_limits_reply) per
-- live node.
local function siq_sources_reply(src)
  local reply = {src.declared_us, src.declared_by, src.declared_at_us, src.override_us,
                 src.override_by, src.override_at_us}
  siq_limits_reply(reply, src.declared_limits)
  siq_override_reply(reply, src.override)
  table.insert(reply, src.limits_by)
  table.insert(reply, src.limits_at_us)
  for node, d in pairs(src.nodes) do
    table.insert(reply, node)
    table.insert(reply, d[1])
    table.insert(reply, d[2])
    siq_limits_reply(reply, d[3])
  end
  return reply
end
