-- start: may ticket ARGV[2] start now? If so, record the start (atomically).
-- KEYS[1]  the queue's state hash, siq:{<queue>}:state
-- KEYS[2]  the queue's finished-task sorted set, siq:{<queue>}:finished
-- KEYS[3]  the queue's ledger stream, siq:{<queue>}:ledger
-- KEYS[4..6]  the queue's parked keys (QueueKeys.all), for idle expiry
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  ticket number
-- ARGV[3]  the ticket's epoch
-- ARGV[4]  task id, or '' (no duplicate check)
-- ARGV[5]  interval in microseconds for a state created here; 0 = do not create
-- ARGV[6]  epoch for a state created here (the ticket's own is then stale: 'reclaim')
-- ARGV[7]  ledger cap (entries kept, about); 0 = write no ledger entry
-- ARGV[8..11]  for the ledger: task name, host, pid, deferrals
-- ARGV[12]  cost: slots this start takes (tickets ARGV[2] .. ARGV[2] + cost - 1, claimed
--           together); the next start may come cost intervals after it
-- ARGV[13]  idle expiry in microseconds (0: never; see siq_touch)
-- Returns {verdict, ticket, now_us, wait_us, slot_us, interval_us}; verdict is one of
-- 'authorized', 'wait', 'paused', 'reclaim', 'duplicate'. With 'paused', wait_us is the
-- ticket's distance behind the head of the line (interval x tickets ahead of it).
local now = siq_now(ARGV[1])
local ticket = tonumber(ARGV[2]) or 0
local cost = tonumber(ARGV[12]) or 1
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then
  if tonumber(ARGV[5]) <= 0 then return redis.error_reply('SIQNOTFOUND') end
  s = siq_new(now, tonumber(ARGV[5]), ARGV[6])
  siq_save(KEYS[1], s)
end
if ARGV[4] ~= '' and redis.call('ZSCORE', KEYS[2], ARGV[4]) then
  return {'duplicate', ticket, now, 0, 0, 0}
end
if ARGV[3] ~= s.epoch or ticket < 1 or ticket + cost - 1 > s.ticket or ticket ~= math.floor(ticket) then
  return {'reclaim', ticket, now, 0, 0, 0}
end
if s.paused == 1 then
  -- wait: the ticket's distance behind the head of the line, for an orderly comeback
  return {'paused', ticket, now, math.max(ticket - s.current - 1, 0) * s.interval_us, 0, s.interval_us}
end

local interval = s.interval_us
if ticket > s.current and siq_shift_after_outage(s, now) then siq_save(KEYS[1], s) end
local due = 0  -- a ticket passed over by current takes the next free slot
if ticket > s.current then due = s.anchor_us + (ticket - s.current) * interval end
local slot = math.max(due, s.last_start_us + interval)
if now < slot then return {'wait', ticket, now, slot - now, slot, interval} end

-- The line continues from this start (for a late ticket: the line behind it shifts one
-- slot and keeps its order). See siq_celery/model.py for why the anchor does not lag.
-- A start of cost c is recorded as if its last slot were used c - 1 intervals from now.
if ticket + cost - 1 > s.current then s.current = ticket + cost - 1 end
s.anchor_us = now + (cost - 1) * interval
s.last_start_us = s.anchor_us
siq_save(KEYS[1], s)
local cap = tonumber(ARGV[7]) or 0
if cap > 0 then
  -- e=s: a start. Short field names: a stream entry keeps them for every entry.
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', cap, '*', 'e', 's', 'ep', s.epoch, 't', ticket, 'id', ARGV[4],
    'n', ARGV[8], 'sl', slot, 'st', now, 'iv', interval, 'h', ARGV[9], 'p', ARGV[10], 'd', ARGV[11])
end
siq_touch(KEYS, s, tonumber(ARGV[13]))
return {'authorized', ticket, now, 0, slot, interval}
