-- Declarations and overrides on the Redis store (part of the prelude: backends/redis_replies.py
-- PRELUDE): a queue's limits as a table and the state run at them, the sources hash read and
-- saved, the effective interval and limits (the strictest of the live declarations), their
-- following of the declarations' expiry, and an operator's override committed.
-- twin: siq_celery/rules/declarations.py

-- A queue's limits beyond the interval, as a table (types.Limits, normalized as
-- declarations.py: _limit_fields): burst, quota, window_us (a quota needs both), concurrency, margin_us; 0 is none.
local function siq_limits(burst, quota, window, conc, margin)
  burst, quota, window = math.max(tonumber(burst) or 0, 0), tonumber(quota) or 0, tonumber(window) or 0
  conc, margin = math.max(tonumber(conc) or 0, 0), math.max(tonumber(margin) or 0, 0)
  if window <= 0 then quota = 0 end
  if quota <= 0 then quota, window = 0, 0 end
  return {burst = burst, quota = quota, window_us = window, concurrency = conc, margin_us = margin}
end

local function siq_limits_equal(a, b)
  return a ~= nil and b ~= nil and a.burst == b.burst and a.quota == b.quota and a.window_us == b.window_us
    and a.concurrency == b.concurrency and a.margin_us == b.margin_us
end

-- The state's limits as declared (types.QueueState.limits): the window without the margin.
local function siq_declared(s)
  local window = 0
  if s.quota > 0 then window = s.window_us - s.margin_us end
  return siq_limits(s.burst, s.quota, window, s.concurrency, s.margin_us)
end

-- The state runs at other limits (declarations.py: set_limits); l: a siq_limits table. The margin
-- goes into the interval and the window in force.
local function siq_set_limits(s, l)
  local interval = s.interval_us - s.margin_us
  s.burst, s.quota, s.concurrency, s.margin_us = l.burst, l.quota, l.concurrency, l.margin_us
  s.interval_us = interval + l.margin_us
  s.window_us = 0
  if l.quota > 0 then s.window_us = l.window_us + l.margin_us end
end

-- Where the interval and the limits come from (declarations.py: declare, override,
-- override_limits, effective_interval, effective_limits): a hash with declared_us,
-- declared_by, declared_at_us, override_us, override_by, override_at_us; the declared
-- limits declared_burst, declared_quota, declared_window_us, declared_conc (absent: none
-- declared, or by an earlier version); the limits override, one field per kind set
-- (override_burst; override_quota with override_window_us; override_conc; absent: that
-- kind not overridden), limits_by and limits_at_us; and per live worker node
-- 'n:<node>' (its declared interval), 'e:<node>' (when its declaration expires unless
-- renewed) and its declared limits 'b:<node>', 'q:<node>', 'w:<node>', 'c:<node>' (absent:
-- a node of an earlier version, which declares none). Returns the fields as a table,
-- nodes in .nodes (node -> {interval, expires, limits or nil}), the declared limits in
-- .declared_limits (nil: none), the override in .override (kind -> value, nil: not
-- overridden), dropping expired nodes from the table (and, with prune, from the hash). A
-- field that holds no whole number where one belongs reads as 0 (a node's interval: the
-- node is dropped); each is listed in .unreadable as 'field value', for the caller's log
-- (the next save of the sources drops it).
local SIQ_TEXT_FIELDS = {declared_by = true, override_by = true, limits_by = true}
local SIQ_NODE_LIMITS = {['b:'] = 'burst', ['q:'] = 'quota', ['w:'] = 'window_us', ['c:'] = 'concurrency',
                         ['m:'] = 'margin_us'}

local function siq_node_fields(node)
  return 'n:' .. node, 'e:' .. node, 'b:' .. node, 'q:' .. node, 'w:' .. node, 'c:' .. node, 'm:' .. node
end

local function siq_sources(key, now, prune)
  local raw = redis.call('HGETALL', key)
  local src = {declared_us = 0, declared_by = '', declared_at_us = 0,
               override_us = 0, override_by = '', override_at_us = 0, limits_by = '', limits_at_us = 0,
               nodes = {}, unreadable = {}}
  local intervals, expires, limits, fields = {}, {}, {}, {}
  for i = 1, #raw, 2 do
    local f, v = raw[i], raw[i + 1]
    local kind, node = string.sub(f, 1, 2), string.sub(f, 3)
    if SIQ_TEXT_FIELDS[f] then
      src[f] = v
    else
      local number = tonumber(v)
      if number == nil or number ~= math.floor(number) or number < 0 then
        table.insert(src.unreadable, f .. ' ' .. v)
        number = 0
      end
      if kind == 'n:' then intervals[node] = number
      elseif kind == 'e:' then expires[node] = number
      elseif SIQ_NODE_LIMITS[kind] then
        limits[node] = limits[node] or {}
        limits[node][SIQ_NODE_LIMITS[kind]] = number
      else fields[f] = number end
    end
  end
  for _, f in ipairs({'declared_us', 'declared_at_us', 'override_us', 'override_at_us', 'limits_at_us'}) do
    if fields[f] then src[f] = fields[f] end
  end
  if fields.declared_burst then
    src.declared_limits = siq_limits(fields.declared_burst, fields.declared_quota, fields.declared_window_us,
                                     fields.declared_conc, fields.declared_margin)
  end
  src.override = {burst = fields.override_burst, concurrency = fields.override_conc, margin_us = fields.override_margin}
  if fields.override_quota then
    local q = siq_limits(0, fields.override_quota, fields.override_window_us, 0, 0)
    src.override.quota, src.override.window_us = q.quota, q.window_us
  end
  for node, interval in pairs(intervals) do
    local e = expires[node]
    if interval > 0 and e and e > now then
      local l = limits[node]
      if l and l.burst then l = siq_limits(l.burst, l.quota, l.window_us, l.concurrency, l.margin_us) else l = nil end
      src.nodes[node] = {interval, e, l}
    elseif prune then
      redis.call('HDEL', key, siq_node_fields(node))
    end
  end
  if prune then  -- an expiry or limits left without their interval
    for _, by_node in ipairs({expires, limits}) do
      for node, _ in pairs(by_node) do
        if not intervals[node] then redis.call('HDEL', key, siq_node_fields(node)) end
      end
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

-- The limits at least as strict as each of a list (declarations.py: strictest): the smallest
-- burst; a quota if any has one, of the smallest N over the longest window among those;
-- the smallest concurrency cap among those with one.
local function siq_strictest(list)
  local burst, quota, window, cap, margin = nil, 0, 0, 0, 0
  for _, l in ipairs(list) do
    if l.margin_us > margin then margin = l.margin_us end
    if burst == nil or l.burst < burst then burst = l.burst end
    if l.quota > 0 then
      if quota == 0 or l.quota < quota then quota = l.quota end
      if l.window_us > window then window = l.window_us end
    end
    if l.concurrency > 0 and (cap == 0 or l.concurrency < cap) then cap = l.concurrency end
  end
  return siq_limits(burst, quota, window, cap, margin)
end

-- Kind by kind: the override if set, else the strictest live declaration (nodes of an
-- earlier version have no say), else the last declaration, else the state's own limits.
local function siq_effective_limits(src, s)
  local live = {}
  for _, d in pairs(src.nodes) do
    if d[3] then table.insert(live, d[3]) end
  end
  local base = src.declared_limits
  if #live > 0 then base = siq_strictest(live) end
  if base == nil then base = siq_declared(s) end
  local o = src.override
  local burst, quota, window, conc, margin = base.burst, base.quota, base.window_us, base.concurrency, base.margin_us
  if o.burst then burst = o.burst end
  if o.quota then quota, window = o.quota, o.window_us end
  if o.concurrency then conc = o.concurrency end
  if o.margin_us then margin = o.margin_us end
  return siq_limits(burst, quota, window, conc, margin)
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

-- The state runs at what its sources give (declarations.py: apply_sources): the effective interval
-- (none: the stored one stays) and limits; until_us follows the live declarations.
local function siq_apply_sources(src, s)
  local effective = siq_effective(src)
  if effective > 0 then s.interval_us = effective + s.margin_us end
  siq_set_limits(s, siq_effective_limits(src, s))
  s.until_us = siq_until(src)
end

-- The effective interval and limits follow the expiry of node declarations (declarations.py:
-- follow_expiry): once the earliest live declaration seen at the last recomputation
-- (s.until_us) has expired, they are recomputed from those still live. Every script that
-- decides by the interval calls it first, so a killed node's declaration stops counting
-- exactly siq_declaration_ttl after its last renewal, on the store's clock, whether or not
-- a live node declares in between. True if s changed (the caller saves it).
local function siq_follow_expiry(sources_key, s, now)
  if s.until_us == 0 or now < s.until_us then return false end
  siq_apply_sources(siq_sources(sources_key, now, true), s)
  return true
end

local function siq_save_sources(key, src)
  redis.call('HSET', key, 'declared_us', src.declared_us, 'declared_by', src.declared_by,
             'declared_at_us', src.declared_at_us, 'override_us', src.override_us,
             'override_by', src.override_by, 'override_at_us', src.override_at_us,
             'limits_by', src.limits_by, 'limits_at_us', src.limits_at_us)
  local d = src.declared_limits
  if d then
    redis.call('HSET', key, 'declared_burst', d.burst, 'declared_quota', d.quota,
               'declared_window_us', d.window_us, 'declared_conc', d.concurrency, 'declared_margin', d.margin_us)
  end
  local o = src.override
  if o.burst then redis.call('HSET', key, 'override_burst', o.burst)
  else redis.call('HDEL', key, 'override_burst') end
  if o.quota then redis.call('HSET', key, 'override_quota', o.quota, 'override_window_us', o.window_us)
  else redis.call('HDEL', key, 'override_quota', 'override_window_us') end
  if o.concurrency then redis.call('HSET', key, 'override_conc', o.concurrency)
  else redis.call('HDEL', key, 'override_conc') end
  if o.margin_us then redis.call('HSET', key, 'override_margin', o.margin_us)
  else redis.call('HDEL', key, 'override_margin') end
end

-- An operator's override written (set_interval, set_limits): the sources saved, the state
-- run at what they now give, saved and touched; the reply is the state (siq_reply), then each
-- unreadable field of the sources as 'field value'.
local function siq_commit_override(keys, s, src, idle_us, now)
  siq_save_sources(keys[7], src)
  siq_apply_sources(src, s)
  siq_save(keys[1], s)
  siq_touch(keys, s, idle_us, now)
  local reply = siq_reply(s, now)
  for _, field in ipairs(src.unreadable) do table.insert(reply, field) end
  return reply
end
