-- The line's tickets on the Redis store (part of the prelude: backends/redis_replies.py PRELUDE): a
-- state created from nothing, and the claim of tickets in line.
-- twin: siq_celery/rules/tickets.py

-- A state created from nothing waits one interval before its first start: it cannot
-- know when the last start was, and that is the price of never bursting after a loss.
-- With a burst the credit starts spent (tickets.py: new_state): still one interval.
local function siq_new(now, interval, epoch, burst, quota, window, conc, margin)
  local s = {epoch = epoch, interval_us = interval, ticket = 0, current = 0, anchor_us = now, last_start_us = now,
             paused = 0, started_us = 0, held_until_us = 0, until_us = 0, idle_us = 0, w_used = 0, pending_us = 0,
             pending_due_us = 0, margin_us = 0}
  siq_set_limits(s, siq_limits(burst, quota, window, conc, margin))
  s.last_start_us = now + s.burst * s.interval_us
  return s
end

-- Issue count tickets (tickets.py: claim; the window, if any, read at now first: siq_units
-- may move the line). Returns the first ticket, when it is due and the floor (the rate cap,
-- or now): ticket n is estimated at max(due + (n - first) * interval, floor).
local function siq_claim(s, count, now)
  local first = s.ticket + 1
  local due = s.anchor_us + (first - s.current) * s.interval_us
  local floor = math.max(now, siq_cap(s))
  local rebase = math.max(now, s.last_start_us + s.interval_us) - s.burst * s.interval_us
  if due < rebase then
    -- The line is overdue (an idle queue), or its head is held by the rate cap: the new
    -- ticket is due at the first free slot and later claims follow one interval apart, so
    -- a burst of claims keeps its ticket order and every estimate matches its slot.
    s.anchor_us = s.anchor_us + (rebase - due)
    due = rebase
  end
  s.ticket = s.ticket + count
  return first, due, floor
end
