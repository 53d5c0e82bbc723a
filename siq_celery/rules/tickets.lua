-- The line's tickets on the Redis store (part of the prelude: backends/redis.py PRELUDE): a
-- queue's limits as a table and the state run at them, a state created from nothing, and the
-- claim of tickets in line.
-- twin: siq_celery/rules/tickets.py

-- A queue's limits beyond the interval, as a table (model.py: Limits, normalized as
-- _limit_fields): burst, quota, window_us (a quota needs both), concurrency, margin_us; 0 is none.
local function siq_limits(burst, quota, window, conc, margin)
  burst, quota, window = math.max(tonumber(burst) or 0, 0), tonumber(quota) or 0, tonumber(window) or 0
  conc, margin = math.max(tonumber(conc) or 0, 0), math.max(tonumber(margin) or 0, 0)
  if window <= 0 then quota = 0 end
  if quota <= 0 then quota, window = 0, 0 end
  return {burst = burst, quota = quota, window_us = window, concurrency = conc, margin_us = margin}
end

local function siq_limits_equal(a, b)
  return a ~= nil and b ~= nil and a.burst == b.burst and a.quota == b.quota and a.window_us == b.window_us
    and a.concurrency == b.concurrency and a.margin_us == b.margin_us
end

-- The state's limits as declared (model.QueueState.limits): the window without the margin.
local function siq_declared(s)
  local window = 0
  if s.quota > 0 then window = s.window_us - s.margin_us end
  return siq_limits(s.burst, s.quota, window, s.concurrency, s.margin_us)
end

-- The state runs at other limits (model.py: set_limits); l: a siq_limits table. The margin
-- goes into the interval and the window in force.
local function siq_set_limits(s, l)
  local interval = s.interval_us - s.margin_us
  s.burst, s.quota, s.concurrency, s.margin_us = l.burst, l.quota, l.concurrency, l.margin_us
  s.interval_us = interval + l.margin_us
  s.window_us = 0
  if l.quota > 0 then s.window_us = l.window_us + l.margin_us end
end

-- A state created from nothing waits one interval before its first start: it cannot
-- know when the last start was, and that is the price of never bursting after a loss.
-- With a burst the credit starts spent (model.py: new_state): still one interval.
local function siq_new(now, interval, epoch, burst, quota, window, conc, margin)
  local s = {epoch = epoch, interval_us = interval, ticket = 0, current = 0, anchor_us = now, last_start_us = now,
             paused = 0, started_us = 0, held_until_us = 0, until_us = 0, idle_us = 0, w_used = 0, pending_us = 0,
             pending_due_us = 0, margin_us = 0}
  siq_set_limits(s, siq_limits(burst, quota, window, conc, margin))
  s.last_start_us = now + s.burst * s.interval_us
  return s
end

-- Issue count tickets (model.py: claim; the window, if any, read at now first: siq_units
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
