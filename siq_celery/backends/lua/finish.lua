-- finish: record that a task finished, so a redelivered copy of it is not run again.
-- KEYS[1]  the queue's finished-task sorted set, siq:{<queue>}:finished (score: time)
-- KEYS[2]  the queue's ledger stream, siq:{<queue>}:ledger
-- KEYS[3..7]  the queue's state hash, parked keys and interval sources, for idle expiry:
--             in the order state, parked, parked messages, releasing, intervals
-- KEYS[8]  the queue's starts without a finish per task id: this one's count is cleared
-- KEYS[9]  the queue's counts, for idle expiry too (they expire with the queue, not before)
-- KEYS[10]  the queue's window (siq_units), for idle expiry too (it must not expire before
--           the state, whose w_used counts its starts)
-- KEYS[11]  the queue's leases (siq_give_back)
-- KEYS[12]  the queue's fair keys with waiting tasks, for idle expiry (they pin the keys)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  task id
-- ARGV[3]  retention in microseconds: older records are dropped
-- ARGV[4]  most records kept (oldest dropped first)
-- ARGV[5]  ledger cap (entries kept, about); 0 = write no ledger entry
-- ARGV[6]  outcome for the ledger (SUCCESS, FAILURE)
-- ARGV[7]  1: remember the task as finished; 0: only write the ledger entry
-- ARGV[8]  idle expiry in microseconds (0: never; see siq_touch)
-- ARGV[9]  the run's lease, given back in this step ('' none); under a concurrency cap the
--          ledger entry names it (l: its tag), with x=1 if it had expired (not given back here)
-- ARGV[10] the queue's wake channel ('' none): a lease given back under a cap wakes the
--          queue's waiters (siq_wake)
-- Returns the number of records kept.
local now = siq_now(ARGV[1])
local cap = tonumber(ARGV[5]) or 0
local function touch()
  local ttl = tonumber(ARGV[8]) or 0
  if ttl > 0 then
    local s = siq_load(KEYS[3])  -- corrupt state: touched as if running (no pause to keep)
    siq_touch({KEYS[3], KEYS[1], KEYS[2], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10],
               KEYS[11], KEYS[12]}, s, ttl, now)
  end
end
local entry = {'e', 'f', 'id', ARGV[2], 'ft', now, 'o', ARGV[6]}
if ARGV[9] and ARGV[9] ~= '' then
  local s = siq_load(KEYS[3])  -- corrupt or missing state: the lease is given back all the same
  local kept = siq_give_back(KEYS[11], KEYS[3], s, ARGV[9], now)
  redis.call('HDEL', KEYS[5], SIQ_RUN_OWNER .. ARGV[9])  -- its owner goes with it (siq_set_owner)
  if s and s.concurrency > 0 then  -- the ledger names a lease taken under a cap only
    if kept == 1 then siq_wake(ARGV[10], s, now) end
    table.insert(entry, 'l')
    table.insert(entry, siq_lease_tag(ARGV[2], ARGV[9]))
    if kept ~= 1 then  -- it had expired: not given back here
      table.insert(entry, 'x')
      table.insert(entry, 1)
    end
  end
end
if cap > 0 then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', cap, '*', unpack(entry))
end
redis.call('ZREM', KEYS[8], ARGV[2])  -- the run ended, whichever way: no lost delivery
if ARGV[7] == '0' then
  touch()
  return redis.call('ZCARD', KEYS[1])
end
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]) - 1)
local kept = redis.call('ZCARD', KEYS[1])
local most = tonumber(ARGV[4])
if kept > most then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, kept - most - 1)
  kept = most
end
touch()
return kept
