-- set_limits: an operator's override of some of the queue's limits (it applies from the next
-- start and holds across worker restarts that do not change the code's declaration of that
-- kind), merged into any earlier one; or clearing every override of them: back to what the
-- code declares (declarations.py: override_limits).
-- KEYS[1..12]  the queue's keys (QueueKeys.all): KEYS[1] its state hash, KEYS[7] its interval
--              sources hash (see siq_sources); all of them for idle expiry
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  the burst override (0: strict spacing), or -1: this kind not set here
-- ARGV[3]  the quota override (0: no quota), or -1: not set here
-- ARGV[4]  the quota's window in microseconds (with a quota above 0)
-- ARGV[5]  the concurrency override (0: no cap), or -1: not set here
-- ARGV[6]  origin, for people: who set it (user, host, pid)
-- ARGV[7]  idle expiry in microseconds, or 0: the queue's own (see siq_touch)
-- ARGV[8]  the margin override in microseconds (0: none), or -1: not set here
-- With every kind -1 the override is cleared.
-- Returns the state as siq_reply, then each unreadable field of the sources as 'field value'
-- (dropped here: siq_sources); error SIQNOTFOUND if the queue has no state.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return redis.error_reply('SIQNOTFOUND') end
local src = siq_sources(KEYS[7], now, true)
local burst, quota, conc, margin = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5]), tonumber(ARGV[8]) or -1
local o = src.override
if burst < 0 and quota < 0 and conc < 0 and margin < 0 then
  src.override = {}
  src.limits_by, src.limits_at_us = '', 0
else
  if burst >= 0 then o.burst = burst end
  if quota >= 0 then
    local q = siq_limits(0, quota, ARGV[4], 0, 0)
    o.quota, o.window_us = q.quota, q.window_us
  end
  if conc >= 0 then o.concurrency = conc end
  if margin >= 0 then o.margin_us = margin end
  src.limits_by, src.limits_at_us = ARGV[6], now
end
return siq_commit_override(KEYS, s, src, tonumber(ARGV[7]), now)
