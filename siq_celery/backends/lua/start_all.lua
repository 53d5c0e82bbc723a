-- start_all: one start that must pass several queues at once (a per-second and a
-- per-day limit): authorized and recorded in every queue, or in none (line.start_all).
-- A queue that would authorize while another says wait answers 'wait' with wait 0: no
-- slot is held in one queue while the start waits for another.
-- KEYS[12i-11..12i]  queue i's keys (QueueKeys.all), all of them for idle expiry (siq_touch):
--                    12i-11 its state hash, 12i-10 finished-task set, 12i-9 ledger stream,
--                    12i-5 interval sources (siq_follow_expiry), 12i-4 counts (of refused and
--                    authorized starts), 12i-2 window (siq_units), 12i-1 leases (siq_read_leases),
--                    12i fair keys with waiting tasks (siq_touch);
--                    KEYS[9], the first queue's starts without a finish per task id (see
--                    siq_unfinished). All keys in one hash slot on Redis Cluster: name the
--                    queues {group}rest.
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  task id, or '' (checked against the first queue's finished tasks)
-- ARGV[3]  ledger cap; 0 = write no ledger entry
-- ARGV[4..7]  for the ledger: task name, host, pid, deferrals
-- ARGV[8]  cost: slots the start takes in every queue
-- ARGV[9]  epoch for a state created here
-- ARGV[10..]  per queue i, four values: ticket, the ticket's epoch, interval in microseconds
--             for a state created here (0 = do not create), idle expiry in microseconds (0:
--             never; see siq_touch); then three more: starts without a finish after which
--             task ARGV[2] is refused ('lost', 0: no limit), the retention (microseconds) and
--             the most records kept of those counts; then per queue i, five values: burst,
--             quota, window, concurrency, margin for a state created here; then the lease member the
--             start takes in each queue with a concurrency cap (and in the first queue when it
--             is the run's, named ARGV[2]: a copy is answered 'running' while it is live), and
--             the lease's time to live (microseconds); then, for the ledger, a fair task's key
--             ('' none), virtual start tag and weight; and last the asking call's token ('' none),
--             kept as the owner of the run's lease in the first queue (start.lua: ARGV[27]),
--             and after it the body's begin wait (start.lua: ARGV[28]; '' or 0: none)
-- Returns one {verdict, ticket, now_us, wait_us, slot_us, interval_us, lease, full} per queue.
local now = siq_now(ARGV[1])
local cost = tonumber(ARGV[8]) or 1
local per = 12  -- keys per queue: QueueKeys.all
local n = #KEYS / per
local lost_args = 10 + 4 * n
local limit_args = lost_args + 3
local lease_args = limit_args + 5 * n
local max_lost = ARGV[2] ~= '' and tonumber(ARGV[lost_args]) or 0  -- concurrency.too_many_lost
local states, tickets, replies = {}, {}, {}
local function key(i, k) return KEYS[per * (i - 1) + k] end  -- queue i's k-th key of QueueKeys.all
local function touch(i)  -- idle expiry: queue i is in use (siq_touch)
  local keys = {}
  for k = 1, per do keys[k] = key(i, k) end
  siq_touch(keys, states[i], tonumber(ARGV[9 + 4 * i]), now)
end
local function count(verdict)  -- a refusal, counted in every queue for the exporter
  for i = 1, n do
    redis.call('HINCRBY', key(i, 8), verdict, 1)
    touch(i)
  end
end
for i = 1, n do
  local s, err = siq_load(key(i, 1))
  if err then return redis.error_reply(err) end
  states[i] = s
  if not s then
    local interval = tonumber(ARGV[8 + 4 * i]) or 0
    if interval <= 0 then return redis.error_reply('SIQNOTFOUND') end
    local at = limit_args + 5 * (i - 1)
    s = siq_new(now, interval, ARGV[9], ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4])
    siq_new_window(key(i, 10))
    siq_save(key(i, 1), s)
    states[i] = s
    touch(i)
  elseif siq_follow_expiry(key(i, 7), s, now) then
    siq_save(key(i, 1), s)
  end
  tickets[i] = tonumber(ARGV[6 + 4 * i]) or 0
end
if ARGV[2] ~= '' and redis.call('ZSCORE', key(1, 2), ARGV[2]) then
  for i = 1, n do replies[i] = {'duplicate', tickets[i], now, 0, 0, 0, '', 0} end
  count('duplicate')
  return replies
end
local run = ARGV[2] ~= '' and ARGV[lease_args] == ARGV[2]  -- the run's lease, in the first queue
local token = run and ARGV[lease_args + 5] or ''
local own_at, own_slot = siq_own_start(key(1, 5), key(1, 11), ARGV[2], token, now)
if own_at then  -- this call's own start, its reply lost: the same, charged once (line.start_all)
  for i = 1, n do
    local lease = ''
    if i == 1 or states[i].concurrency > 0 then lease = ARGV[lease_args] end
    replies[i] = {'authorized', tickets[i], own_at, 0, own_slot, states[i].interval_us, lease, 0}
  end
  return replies
end
local running = siq_running(key(1, 11), ARGV[2], now)  -- a copy of this task runs (concurrency.running_copy)
if running then
  for i = 1, n do replies[i] = {'running', tickets[i], now, running - now, 0, states[i].interval_us, '', 0} end
  count('running')
  return replies
end
if max_lost > 0 and siq_unfinished(key(1, 9), ARGV[2], now, tonumber(ARGV[lost_args + 1])) >= max_lost then
  for i = 1, n do replies[i] = {'lost', tickets[i], now, 0, 0, 0, '', 0} end
  return replies
end
local placed = false  -- a start needs a place in some line: not every ticket FREE (0)
for i = 1, n do
  if tickets[i] ~= 0 then placed = true end
end
if not placed then
  for i = 1, n do replies[i] = {'reclaim', tickets[i], now, 0, 0, 0, '', 0} end
  count('reclaim')
  return replies
end
local all = true
for i = 1, n do
  local verdict, wait, slot, full = siq_decide(key(i, 1), states[i], tickets[i], ARGV[7 + 4 * i], cost, now,
                                               key(i, 10), key(i, 11))
  if verdict == 'reclaim' then
    redis.call('HINCRBY', key(i, 8), 'reclaim', 1)
    touch(i)
  end
  local interval = states[i].interval_us
  if verdict == 'reclaim' then interval = 0 end
  replies[i] = {verdict, tickets[i], now, wait, slot, interval, '', full and 1 or 0}
  if verdict ~= 'authorized' then all = false end
end
if not all then
  for i = 1, n do
    if replies[i][1] == 'authorized' then replies[i][1] = 'wait' end
  end
  return replies
end
local cap = tonumber(ARGV[3]) or 0
if max_lost > 0 then
  siq_count_unfinished(key(1, 9), ARGV[2], now, tonumber(ARGV[lost_args + 1]), tonumber(ARGV[lost_args + 2]))
end
for i = 1, n do
  local s = states[i]
  replies[i][7] = siq_commit(key(i, 1), s, tickets[i], cost, now, key(i, 10), key(i, 11),
                              ARGV[lease_args], now + tonumber(ARGV[lease_args + 1]), i == 1 and run,
                              tonumber(ARGV[lease_args + 6]) or 0)
  siq_ledger_start(key(i, 3), cap, s, tickets[i], ARGV[2], replies[i][5], now, ARGV[4], ARGV[5], ARGV[6], ARGV[7], cost,
                   replies[i][7], tonumber(ARGV[lease_args + 1]),
                   {ARGV[lease_args + 2], ARGV[lease_args + 3], ARGV[lease_args + 4]})
  siq_count_start(key(i, 8), now, replies[i][5], replies[i][6], tonumber(ARGV[7]) or 0)
end
if run then  -- with the latest of the queues' slots, which each queue answers again (line.start_all)
  local latest = 0
  for i = 1, n do latest = math.max(latest, replies[i][5]) end
  siq_set_owner(key(1, 5), ARGV[2], token, now, latest)
end
for i = 1, n do touch(i) end
return replies
