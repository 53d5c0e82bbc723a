-- reset: a new life for the queue (new epoch; tickets and pause forgotten). The last start
-- is kept, so a reset never allows a burst; finished-task records are kept too.
-- Overwrites corrupt state (the way out of SIQCORRUPT).
-- KEYS[1..12]  the queue's keys (QueueKeys.all), all of them for idle expiry (siq_touch):
--              KEYS[1] its state hash; KEYS[4], KEYS[5], KEYS[6] parked tasks not leased,
--              parked messages, leased tasks (parked tasks are numbered 1..n in their order,
--              so they keep their place in the new life); KEYS[7] its interval sources hash
--              (a given interval is pinned: declarations.py: pin); KEYS[10] its window (emptied for a
--              state created here); KEYS[11] its leases (kept; the keys outlive them);
--              KEYS[12] its fair keys with waiting tasks (the fair lines are kept, and the
--              virtual time with them)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  interval in microseconds, or 0 to keep the stored one
-- ARGV[3]  the new epoch
-- ARGV[4]  origin, for people: who reset it with that interval
-- ARGV[5]  idle expiry in microseconds, or 0: the queue's own (an operator's command does
--          not know it; a per-key queue keeps expiring when idle: siq_touch)
-- ARGV[6..10]  burst, quota, window (microseconds), concurrency, margin for a state created here; an
--          existing state keeps its limits, its window (the starts happened) and its leases
--          (the bodies still run)
-- Returns the state as siq_reply, then each unreadable field of the sources as 'field value'
-- (dropped here: siq_sources); error SIQNOTFOUND if there is no state and ARGV[2] = 0.
local now = siq_now(ARGV[1])
local interval = tonumber(ARGV[2])
local s = siq_load(KEYS[1])  -- corrupt state is replaced, not reported
local seq = redis.call('HGET', KEYS[1], 'w_seq')
local cum = redis.call('HGET', KEYS[1], 'w_cum')  -- the window's numbering (siq_units) is kept with it
local fair_v = redis.call('HGET', KEYS[1], 'fair_v')  -- the fair lines are kept (siq_fair)
local old = s
if s then
  siq_follow_expiry(KEYS[7], s, now)
  if interval <= 0 then interval = s.interval_us - s.margin_us end  -- the declared interval: the margin is added again
elseif interval <= 0 then
  return redis.error_reply('SIQNOTFOUND')  -- missing (or corrupt) state and no interval given
else
  old = siq_new(now, interval, ARGV[3], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10])
  siq_new_window(KEYS[10])
end
redis.call('DEL', KEYS[1])
local kept = siq_declared(old)
s = siq_new(now, interval, ARGV[3], kept.burst, kept.quota, kept.window_us, kept.concurrency, kept.margin_us)
s.last_start_us, s.until_us, s.idle_us, s.w_used = old.last_start_us, old.until_us, old.idle_us, old.w_used
local started, held = old.started_us, old.held_until_us
if seq then redis.call('HSET', KEYS[1], 'w_seq', seq) end
if cum then redis.call('HSET', KEYS[1], 'w_cum', cum) end
if fair_v then redis.call('HSET', KEYS[1], 'fair_v', fair_v) end
s.started_us, s.held_until_us = started, held  -- kept, as the last start is
s.pending_us, s.pending_due_us = old.pending_us, old.pending_due_us  -- its body still begins, and reports
s.anchor_us = now - s.interval_us  -- ticket 1 of the new life is due at once (the margin in its spacing)
local parked = {}
for _, key in ipairs({KEYS[4], KEYS[6]}) do
  for _, id in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    local v = redis.call('HGET', KEYS[5], id)
    if v then
      local bar = string.find(v, '|', 1, true)
      table.insert(parked, {tonumber(string.sub(v, 1, bar - 1)), id, string.sub(v, bar + 1)})
    end
  end
end
table.sort(parked, function(a, b) return a[1] < b[1] end)
redis.call('DEL', KEYS[4], KEYS[6])
for n, p in ipairs(parked) do
  redis.call('ZADD', KEYS[4], n, p[2])
  redis.call('HSET', KEYS[5], p[2], n .. '|' .. p[3])
end
s.ticket = #parked
local unreadable = {}
if tonumber(ARGV[2]) > 0 then
  local src = siq_sources(KEYS[7], now, true)
  unreadable = src.unreadable
  local live = false
  for _ in pairs(src.nodes) do live = true end
  if src.declared_us == 0 and not live then
    src.declared_us, src.declared_by, src.declared_at_us = interval, ARGV[4], now
  else
    src.override_us = 0
    if interval == siq_effective(src) then
      src.override_by, src.override_at_us = '', 0
    else
      src.override_us, src.override_by, src.override_at_us = interval, ARGV[4], now
    end
  end
  siq_save_sources(KEYS[7], src)
  s.until_us = siq_until(src)
end
siq_save(KEYS[1], s)
siq_touch(KEYS, s, tonumber(ARGV[5]), now)
local reply = siq_reply(s, now)
for _, field in ipairs(unreadable) do table.insert(reply, field) end
return reply
