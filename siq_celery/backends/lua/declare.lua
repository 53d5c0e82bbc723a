-- declare: the code declares an interval and limits for the queue (a worker starting or
-- renewing its declaration, a worker shutting down, `siq sync`); the effective interval and
-- limits are recomputed in the same step (declarations.py: declare).
-- KEYS[1..12]  the queue's keys (QueueKeys.all), all of them for idle expiry (siq_touch):
--              KEYS[1] its state hash (created here if missing); KEYS[7] its interval sources
--              hash (see siq_sources); KEYS[10] its window (siq_units: emptied for a state
--              created here); KEYS[11] its leases (the keys outlive the bodies still running)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  the declared interval in microseconds (> 0)
-- ARGV[3]  epoch for a state created here
-- ARGV[4]  the declaring worker node, or '' (a script: no registration)
-- ARGV[5]  microseconds the node's declaration counts unless renewed; 0 withdraws it
-- ARGV[6]  origin, for people: who declared (node, host, pid)
-- ARGV[7]  1: announce (a new declaration replaces the last one, and the override of what
--          changed); 0: renew
-- ARGV[8]  idle expiry in microseconds (0: never; see siq_touch)
-- ARGV[9..13]  the declared burst, quota, window (microseconds), concurrency, margin: the node's
--          declaration, the queue's declaration with an announcement, and a state created here's
-- Returns {created (0|1), old declared_us, declared_us, old interval_us, interval_us,
-- replaced override_us (0: none), its origin}, then the old and new declared limits, the
-- old and new effective limits (five values each: siq_limits_reply), the kinds of the
-- limits override replaced (siq_override_reply) and its origin; then each unreadable field
-- of the sources as 'field value' (dropped here: siq_sources).
local now = siq_now(ARGV[1])
local interval = tonumber(ARGV[2])
local node, ttl, origin, announce = ARGV[4], tonumber(ARGV[5]), ARGV[6], ARGV[7] == '1'
local limits = siq_limits(ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
local created, old_interval = 0, 0
if not s then
  s = siq_new(now, interval, ARGV[3], ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13])
  siq_new_window(KEYS[10])
  created = 1
else
  old_interval = s.interval_us
end
local old_limits = siq_declared(s)
local src = siq_sources(KEYS[7], now, true)
if node ~= '' then
  if ttl > 0 then
    local n, e, b, q, w, c, m = siq_node_fields(node)
    redis.call('HSET', KEYS[7], n, interval, e, now + ttl, b, limits.burst, q, limits.quota, w, limits.window_us,
               c, limits.concurrency, m, limits.margin_us)
    src.nodes[node] = {interval, now + ttl, limits}
  else
    redis.call('HDEL', KEYS[7], siq_node_fields(node))
    src.nodes[node] = nil
  end
end
local old_declared, replaced, replaced_by = src.declared_us, 0, ''
if (announce and interval ~= src.declared_us) or src.declared_us == 0 then
  src.declared_us, src.declared_by, src.declared_at_us = interval, origin, now
  if announce and src.override_us > 0 then
    replaced, replaced_by = src.override_us, src.override_by
    src.override_us, src.override_by, src.override_at_us = 0, '', 0
  end
end
local old_declared_limits, o, replaced_limits, replaced_limits_by = src.declared_limits, src.override, {}, ''
if (announce and not siq_limits_equal(limits, old_declared_limits)) or old_declared_limits == nil then
  src.declared_limits = limits
  if announce then  -- the override of each kind the code changed goes (every kind: nothing declared before)
    local was, any = old_declared_limits, false
    if o.burst and (was == nil or was.burst ~= limits.burst) then
      replaced_limits.burst, o.burst, any = o.burst, nil, true
    end
    if o.quota and (was == nil or was.quota ~= limits.quota or was.window_us ~= limits.window_us) then
      replaced_limits.quota, replaced_limits.window_us, o.quota, o.window_us, any = o.quota, o.window_us, nil, nil, true
    end
    if o.concurrency and (was == nil or was.concurrency ~= limits.concurrency) then
      replaced_limits.concurrency, o.concurrency, any = o.concurrency, nil, true
    end
    if o.margin_us and (was == nil or was.margin_us ~= limits.margin_us) then
      replaced_limits.margin_us, o.margin_us, any = o.margin_us, nil, true
    end
    if any then
      replaced_limits_by = src.limits_by
      if not (o.burst or o.quota or o.concurrency or o.margin_us) then src.limits_by, src.limits_at_us = '', 0 end
    end
  end
end
siq_save_sources(KEYS[7], src)
siq_apply_sources(src, s)
siq_save(KEYS[1], s)
siq_touch(KEYS, s, tonumber(ARGV[8]), now)
local reply = {created, old_declared, src.declared_us, old_interval, s.interval_us, replaced, replaced_by}
siq_limits_reply(reply, old_declared_limits)
siq_limits_reply(reply, src.declared_limits)
siq_limits_reply(reply, old_limits)
siq_limits_reply(reply, siq_declared(s))
siq_override_reply(reply, replaced_limits)
table.insert(reply, replaced_limits_by)
for _, field in ipairs(src.unreadable) do table.insert(reply, field) end
return reply
