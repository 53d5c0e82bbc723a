-- The start decision on the Redis store, last of the prelude (backends/redis_replies.py PRELUDE): may a
-- ticket start now, by every kind of limit at once (siq_decide), and an authorized start
-- recorded (siq_commit).
-- twin: siq_celery/rules/line.py

-- May ticket start now (line.decide; ticket 0 is FREE: no place in the line, the next
-- free slot)? Returns verdict, wait_us, slot_us; the state is
-- saved if the line shifted after an outage (that repair is due whatever the answer).
-- With 'paused', wait_us is the ticket's distance behind the head of the line. wkey: the
-- queue's window (its quota's starts); lkey: its leases. A fourth value, true: 'wait' because
-- the slot came and the concurrency cap is full, or the free leases are claimed by the
-- tickets ahead (siq_lease_turn); wait_us: a short poll, or until the claim lapses.
local function siq_decide(key, s, ticket, epoch, cost, now, wkey, lkey)
  if ticket == 0 then  -- FREE: no place in this queue's line; the next free slot
    if s.paused == 1 then return 'paused', 0, 0 end
    local full = s.concurrency > 0 and siq_live(lkey, key, s, now) >= s.concurrency
    local cap = math.max(siq_cap(s), siq_window_slot(siq_units(wkey, key, s, now), 0, cost))
    if now < cap then return 'wait', cap - now, cap end
    if full then return 'wait', siq_lease_wait(lkey, now), cap, true end
    if s.pending_us > now then return 'wait', siq_pending_wait(s, now), cap end
    return 'authorized', 0, cap
  end
  if epoch ~= s.epoch or ticket < 1 or ticket + cost - 1 > s.ticket or ticket ~= math.floor(ticket) then
    return 'reclaim', 0, 0
  end
  if s.paused == 1 then
    return 'paused', math.max(ticket - s.current - 1, 0) * s.interval_us, 0
  end
  local live = siq_live(lkey, key, s, now)  -- first: a release may move the line
  local full = s.concurrency > 0 and live >= s.concurrency
  local u = siq_units(wkey, key, s, now)
  if ticket > s.current then  -- a head held by the window or by a full cap is not late
    local held = siq_window_slot(u, s.current + 1, 1)
    if full then held = math.max(held, now) end
    if siq_shift_after_outage(s, now, 0, held) then siq_save(key, s) end
  end
  local due = 0  -- a ticket passed over by current takes the next free slot
  if ticket > s.current then due = s.anchor_us + (ticket - s.current) * s.interval_us end
  local slot = math.max(due, siq_cap(s), siq_window_slot(u, ticket, cost))
  if now < slot then return 'wait', slot - now, slot end
  if full then return 'wait', siq_lease_wait(lkey, now), slot, true end
  local turn = siq_lease_turn(s, ticket, live)  -- the tickets ahead keep their claims on the leases
  if now < turn then return 'wait', math.min(siq_lease_wait(lkey, now), turn - now), slot, true end
  -- the last start's body has not said it began: its start may still move
  if s.pending_us > now then return 'wait', siq_pending_wait(s, now), slot end
  return 'authorized', 0, slot
end

-- Record an authorized start (line.commit_start): the line continues from it (a late
-- ticket takes the slot current+1 was due at, and the line behind shifts one slot; a line
-- due later stays where it is); a start of cost c is recorded as if its last slot were
-- used c - 1 intervals from now. GCRA: T = max(T, now) + cost intervals; with a burst the
-- line keeps its grid, at most burst intervals behind. With a quota the start joins the
-- window (wkey). The start takes one lease, whatever its cost: member, expiring at expires,
-- in lkey, under a concurrency cap or when run is true (the run's lease, named by its task
-- id: siq_running); a queue without a cap first forgets its expired ones (a capped queue's
-- were read by siq_decide). begin_wait (microseconds, 0: none): the body will report when it
-- began (began.lua); later starts wait for it that long at most. Returns the member taken, or ''.
local function siq_commit(key, s, ticket, cost, now, wkey, lkey, member, expires, run, begin_wait)
  local i, old = s.interval_us, s.current
  if ticket > 0 and ticket + cost - 1 > s.current then s.current = ticket + cost - 1 end
  if begin_wait and begin_wait > 0 then
    s.pending_us, s.pending_due_us = now + begin_wait, s.last_start_us + s.interval_us  -- GCRA's T then
  else
    s.pending_us, s.pending_due_us = 0, 0
  end
  local newest = s.started_us  -- the newest start in the window, if any (siq_units)
  s.started_us = now  -- what the status shows; the cap counts from the last slot used
  s.last_start_us = math.max(s.last_start_us + i, now) + (cost - 1) * i
  s.anchor_us = math.max(s.anchor_us + (s.current - old) * i, s.last_start_us - s.burst * i)
  -- Only the fields a start changes are written (a whole siq_save costs the start about a
  -- sixth of its server time): whatever else changed since the load was written then.
  if s.quota > 0 then
    local units = math.min(cost, s.quota)
    local n = redis.call('HINCRBY', key, 'w_cum', units)
    if n == units and redis.call('ZCARD', wkey) > 0 then  -- w_cum was missing: number the starts kept first
      siq_window_number(wkey, key, s)
      n = redis.call('HINCRBY', key, 'w_cum', units)
    end
    redis.call('ZADD', wkey, now, siq_member(n, units))
    s.w_used = s.w_used + units
    if now < newest then siq_window_number(wkey, key, s) end  -- a start out of time order: numbered anew
    redis.call('HSET', key, 'current', s.current, 'anchor_us', s.anchor_us, 'last_start_us', s.last_start_us,
               'started_us', s.started_us, 'w_used', s.w_used, 'pend_us', s.pending_us, 'pend_due', s.pending_due_us)
  else
    redis.call('HSET', key, 'current', s.current, 'anchor_us', s.anchor_us, 'last_start_us', s.last_start_us,
               'started_us', s.started_us, 'pend_us', s.pending_us, 'pend_due', s.pending_due_us)
  end
  if not member or member == '' or (s.concurrency <= 0 and not run) then return '' end
  if s.concurrency <= 0 then redis.call('ZREMRANGEBYSCORE', lkey, '-inf', now) end
  redis.call('ZADD', lkey, expires, member)
  return member
end
