-- start: may ticket ARGV[2] start now? If so, record the start (atomically).
-- KEYS[1]  the queue's state hash, siq:{<queue>}:state
-- KEYS[2]  the queue's finished-task sorted set, siq:{<queue>}:finished
-- KEYS[3]  the queue's ledger stream, siq:{<queue>}:ledger
-- KEYS[4..7]  the queue's parked keys and interval sources (QueueKeys.all), for idle expiry;
--           KEYS[7] (interval sources) also for siq_follow_expiry
-- KEYS[8]  the queue's counts: of refused starts (duplicate, reclaim) and of authorized
--          ones (siq_count_start)
-- KEYS[9]  the queue's starts without a finish per task id (sorted set, see siq_unfinished)
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
-- ARGV[14]  starts without a finish after which task ARGV[4] is refused ('lost'); 0: no limit
-- ARGV[15], ARGV[16]  retention (microseconds) and most records kept of those counts
-- ARGV[17..21]  burst, quota, window (microseconds), concurrency, margin for a state created here
-- ARGV[22]  the lease member an authorized start takes: the run's (named ARGV[4], taken in any
--           queue; a copy of the task is answered 'running' while it is live), or another
--           (taken only in a queue with a concurrency cap)
-- ARGV[23]  the lease's time to live (microseconds): siq_lease_timeout
-- ARGV[24..26]  for the ledger: a fair task's key ('' none), virtual start tag and weight
-- ARGV[27]  the asking call's token ('' none): kept as the owner of the run's lease (with a
--           task id, in the parked messages hash KEYS[5]: siq_set_owner); a start it was
--           given already, whose reply was lost, is answered again as it was and records
--           nothing (siq_own_start), where another asker is answered 'running'
-- ARGV[28]  the body's begin wait in microseconds ('' or 0: none): the body will report when it
--           began (began.lua); later starts wait for that report this long at most
-- KEYS[10]  the queue's window (siq_units); KEYS[11]  its leases (siq_read_leases)
-- KEYS[12]  the queue's fair keys with waiting tasks, for idle expiry (siq_touch)
-- Returns {verdict, ticket, now_us, wait_us, slot_us, interval_us, lease, full}; verdict is one of
-- 'authorized', 'wait', 'paused', 'reclaim', 'duplicate', 'running', 'lost'. With 'running', wait_us
-- is until the running copy's lease expires (unless renewed). With 'paused', wait_us is the
-- ticket's distance behind the head of the line (interval x tickets ahead of it). lease: the
-- member taken ('' none); full: 1 when 'wait' because the concurrency cap is full.
local now = siq_now(ARGV[1])
local ticket = tonumber(ARGV[2]) or 0
local cost = tonumber(ARGV[12]) or 1
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then
  if tonumber(ARGV[5]) <= 0 then return redis.error_reply('SIQNOTFOUND') end
  s = siq_new(now, tonumber(ARGV[5]), ARGV[6], ARGV[17], ARGV[18], ARGV[19], ARGV[20], ARGV[21])
  siq_new_window(KEYS[10])
  siq_save(KEYS[1], s)
  siq_touch(KEYS, s, tonumber(ARGV[13]), now)
elseif siq_follow_expiry(KEYS[7], s, now) then
  siq_save(KEYS[1], s)
end
local function refused(verdict)  -- counted for the exporter; the count expires with the queue
  redis.call('HINCRBY', KEYS[8], verdict, 1)
  siq_touch(KEYS, s, tonumber(ARGV[13]), now)
end
if ARGV[4] ~= '' and redis.call('ZSCORE', KEYS[2], ARGV[4]) then
  refused('duplicate')
  return {'duplicate', ticket, now, 0, 0, 0, '', 0}
end
local run = ARGV[4] ~= '' and ARGV[22] == ARGV[4]  -- the lease taken is the run's
local token = run and ARGV[27] or ''
local own_at, own_slot = siq_own_start(KEYS[5], KEYS[11], ARGV[4], token, now)
if own_at then  -- this call's own start, its reply lost: the same, charged once (line.start)
  return {'authorized', ticket, own_at, math.max(own_at - now, 0), own_slot, s.interval_us, ARGV[22], 0}
end
local running = siq_running(KEYS[11], ARGV[4], now)  -- a copy of this task runs (concurrency.running_copy)
if running then
  refused('running')
  return {'running', ticket, now, running - now, 0, s.interval_us, '', 0}
end
local max_lost = ARGV[4] ~= '' and tonumber(ARGV[14]) or 0  -- poison messages (concurrency.too_many_lost)
if max_lost > 0 and siq_unfinished(KEYS[9], ARGV[4], now, tonumber(ARGV[15])) >= max_lost then
  return {'lost', ticket, now, 0, 0, 0, '', 0}
end
if ticket < 1 then  -- FREE is for start_all only
  refused('reclaim')
  return {'reclaim', ticket, now, 0, 0, 0, '', 0}
end
local verdict, wait, slot, full = siq_decide(KEYS[1], s, ticket, ARGV[3], cost, now, KEYS[10], KEYS[11])
local at = now  -- a start whose body reports may be authorized for its slot, its body held until then (line.start)
if verdict == 'wait' and not full and (tonumber(ARGV[28]) or 0) > 0 and wait == slot - now
   and wait <= siq_start_lead(s) then
  local v2, _, slot2 = siq_decide(KEYS[1], s, ticket, ARGV[3], cost, slot, KEYS[10], KEYS[11])
  if v2 == 'authorized' then verdict, wait, at, slot = v2, slot - now, slot, slot2 end
end
if verdict == 'reclaim' then refused('reclaim') end
if verdict ~= 'authorized' then
  local interval = s.interval_us
  if verdict == 'reclaim' then interval = 0 end
  return {verdict, ticket, now, wait, slot, interval, '', full and 1 or 0}
end
local interval = s.interval_us  -- the interval this start was measured against
local lease = siq_commit(KEYS[1], s, ticket, cost, at, KEYS[10], KEYS[11], ARGV[22], now + tonumber(ARGV[23]), run,
                         tonumber(ARGV[28]) or 0)
if run then siq_set_owner(KEYS[5], ARGV[4], token, at, slot) end
if max_lost > 0 then siq_count_unfinished(KEYS[9], ARGV[4], now, tonumber(ARGV[15]), tonumber(ARGV[16])) end
siq_ledger_start(KEYS[3], tonumber(ARGV[7]) or 0, s, ticket, ARGV[4], slot, at, ARGV[8], ARGV[9], ARGV[10], ARGV[11], cost,
                 lease, tonumber(ARGV[23]), {ARGV[24], ARGV[25], ARGV[26]})
siq_count_start(KEYS[8], at, slot, interval, tonumber(ARGV[11]) or 0)
siq_touch(KEYS, s, tonumber(ARGV[13]), now)
return {'authorized', ticket, at, at - now, slot, interval, lease, 0}
