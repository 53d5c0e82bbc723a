-- The spacing of starts on the Redis store (part of the prelude: backends/redis_replies.py PRELUDE):
-- the rate cap with its burst (GCRA), how long before its slot a start may be authorized, the
-- wait for a body that has not reported it began, and the shift of the line after an outage.
-- twin: siq_celery/rules/spacing.py

-- How long before its slot a start whose body reports may be authorized (spacing.start_lead_us).
local function siq_start_lead(s)
  return math.min(math.floor(s.interval_us / 4), 5000)
end

-- How long a start whose slot came waits before asking again while the last start's body
-- has not reported (spacing.pending_wait): a quarter interval, 0.5 to 5 ms, never past expiry.
local function siq_pending_wait(s, now)
  return math.max(math.min(math.max(math.floor(s.interval_us / 4), 500), 5000, s.pending_us - now), 1)
end

-- The rate cap (spacing.py: cap): GCRA's theoretical arrival time less the burst tolerance.
local function siq_cap(s)
  return s.last_start_us + s.interval_us - s.burst * s.interval_us
end

-- After an outage (no start, head overdue by more than max(10 intervals, 1 s), or than
-- overdue if longer: a release passes its horizon) the backlog shifts once so the head is
-- due max(10 intervals, 1 s) from now (spacing.py: shift_after_outage).
-- held: when the window quota lets the head start (a head the window holds is not late).
local function siq_shift_after_outage(s, now, overdue, held)
  local settle = math.max(10 * s.interval_us, 1000000)
  if s.anchor_us > s.last_start_us + s.interval_us then return false end  -- shifted already
  if math.max(s.anchor_us + s.interval_us, held or 0) >= now - math.max(settle, overdue) then return false end
  s.anchor_us = now + settle - s.interval_us
  return true
end
