-- declare: the code declares an interval for the queue (a worker starting or renewing its
-- declaration, a worker shutting down, `siq sync`); the effective interval is recomputed
-- in the same step (model.py: declare).
-- KEYS[1..11]  the queue's keys (QueueKeys.all), all of them for idle expiry (siq_touch):
--              KEYS[1] its state hash (created here if missing); KEYS[7] its interval sources
--              hash (see siq_sources); KEYS[10] its window (siq_units: emptied for a state
--              created here); KEYS[11] its leases (the keys outlive the bodies still running)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  the declared interval in microseconds (> 0)
-- ARGV[3]  epoch for a state created here
-- ARGV[4]  the declaring worker node, or '' (a script: no registration)
-- ARGV[5]  microseconds the node's declaration counts unless renewed; 0 withdraws it
-- ARGV[6]  origin, for people: who declared (node, host, pid)
-- ARGV[7]  1: announce (a new declaration replaces the last one and any override); 0: renew
-- ARGV[8]  idle expiry in microseconds (0: never; see siq_touch)
-- ARGV[9..12]  the declared burst, quota, window (microseconds), concurrency: the queue's with an
--          announcement (or a state created here)
-- Returns {created (0|1), old declared_us, declared_us, old interval_us, interval_us,
-- replaced override_us (0: none), its origin}, then each unreadable field of the sources
-- as 'field value' (dropped here: siq_sources).
local now = siq_now(ARGV[1])
local interval = tonumber(ARGV[2])
local node, ttl, origin, announce = ARGV[4], tonumber(ARGV[5]), ARGV[6], ARGV[7] == '1'
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
local created, old_interval = 0, 0
if not s then
  s = siq_new(now, interval, ARGV[3], ARGV[9], ARGV[10], ARGV[11], ARGV[12])
  siq_new_window(KEYS[10])
  created = 1
else
  old_interval = s.interval_us
end
local src = siq_sources(KEYS[7], now, true)
if node ~= '' then
  if ttl > 0 then
    redis.call('HSET', KEYS[7], 'n:' .. node, interval, 'e:' .. node, now + ttl)
    src.nodes[node] = {interval, now + ttl}
  else
    redis.call('HDEL', KEYS[7], 'n:' .. node, 'e:' .. node)
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
siq_save_sources(KEYS[7], src)
local effective = siq_effective(src)
if effective > 0 then s.interval_us = effective end
s.until_us = siq_until(src)
if announce then siq_set_limits(s, ARGV[9], ARGV[10], ARGV[11], ARGV[12]) end
siq_save(KEYS[1], s)
siq_touch(KEYS, s, tonumber(ARGV[8]), now)
local reply = {created, old_declared, src.declared_us, old_interval, s.interval_us, replaced, replaced_by}
for _, field in ipairs(src.unreadable) do table.insert(reply, field) end
return reply
