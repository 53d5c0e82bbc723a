-- began: the body of a start reports, as it begins, that it began (line.began). If that
-- start is still the queue's last, pending one, it is placed as if it had been authorized
-- now (the report is written just before the body's first statement: it arrives after the
-- body began), and later starts stop waiting for it. Only ever delays later starts. A report
-- sent again (the body's process stood still after the first) moves it again while no later
-- start came: pend_us holds minus the authorization's time then.
-- The ledger gets the report (e=b: the start authorized at st, of task id, began at bt) when
-- the body begins: the start still held, or the body did not wait for this answer (ARGV[5]).
-- KEYS[1]  the queue's state hash
-- KEYS[2]  the queue's window (siq_units): with a quota the start moves there too
-- KEYS[3]  the queue's ledger stream
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  when the start was authorized (its started_us), microseconds
-- ARGV[3]  ledger cap (entries kept, about); 0 = write no ledger entry
-- ARGV[4]  the start's task id ('' none)
-- ARGV[5]  1: the body begins whatever the answer (a report not waited for)
-- A report of an overtaken start (a later start came while its process stood still) is
-- charged as one more start now under a burst with room (spacing.charge_overtaken).
-- Returns the start's new time, or 0 if it is not the last pending start any more and
-- was not charged.
local now = siq_now(ARGV[1])
local authorized = tonumber(ARGV[2])
local function ledger(at)
  local cap = tonumber(ARGV[3]) or 0
  if cap > 0 then
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', cap, '*', 'e', 'b', 'id', ARGV[4] or '', 'st', authorized, 'bt', at)
  end
end
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
if not s then return 0 end
local again = s.pending_us < 0 and s.pending_us == -authorized  -- reported already: a report sent again
if not again and (s.pending_us <= 0 or s.started_us ~= authorized) then
  -- overtaken (spacing.charge_overtaken): under a burst, without a quota and not paused, charged
  -- as one more start now if the rate cap has room; its place at its authorization stays charged too
  if s.burst > 0 and s.quota <= 0 and s.paused ~= 1 and siq_cap(s) <= now then
    s.last_start_us = math.max(s.last_start_us + s.interval_us, now)
    s.anchor_us = math.max(s.anchor_us, s.last_start_us - s.burst * s.interval_us)
    redis.call('HSET', KEYS[1], 'last_start_us', s.last_start_us, 'anchor_us', s.anchor_us)
    ledger(now)
    return now
  end
  if ARGV[5] == '1' then ledger(now) end
  return 0
end
local at = math.max(now, s.started_us)
local i = s.interval_us
-- the last slot worked out again from the slot used before it plus the interval then (pend_due),
-- as siq_commit did from the authorization: a start that came early under a burst moves only by what the delay takes
-- it past that slot plus one interval
local base = s.pending_due_us
s.last_start_us = s.last_start_us + math.max(base, at) - math.max(base, s.started_us)
s.anchor_us = math.max(s.anchor_us, s.last_start_us - s.burst * i)
if s.quota > 0 and at ~= s.started_us then
  siq_window_move(KEYS[2], s.started_us, at)
end
s.started_us = at
s.pending_us = -authorized  -- reported: nothing waits for it, and a report sent again finds it
redis.call('HSET', KEYS[1], 'last_start_us', s.last_start_us, 'anchor_us', s.anchor_us, 'started_us', s.started_us,
           'pend_us', s.pending_us)
ledger(at)
return at
