-- Prepended to every siq_celery script when it is loaded (backends/redis.py).
-- Helpers: the store clock, and loading / checking / saving one queue's state hash.
--
-- Times are integer microseconds since the Unix epoch (they fit a Lua double exactly).
-- Numbers reach Redis through redis.call, which formats them with %.17g; never build a
-- number into a string with tostring() or '..' (Lua's own format keeps 14 digits).
-- State hash fields: epoch, interval_us, ticket, current, anchor_us, last_start_us, paused;
-- two that only the status shows (no decision reads them; absent means 0): started_us,
-- when the last start was authorized, and held_until_us, when the last back-off ends;
-- and two that may be missing (read as 0): until_us, when the earliest live node declaration
-- expires (the interval is recomputed then: siq_follow_expiry), and idle_us, the queue's
-- idle expiry (siq_touch), so that an operator's reset or override keeps it.
-- The limits beyond the interval (absent means 0; model.py): burst, quota and window_us, and
-- w_used, the cost units in the queue's window (a sorted set of starts: siq_units), w_cum
-- numbering its units (w_seq: an earlier version's numbering of its starts); conc, the concurrency cap (its leases: a sorted set, siq_read_leases).
-- fair_v (absent means 0): a fair queue's virtual time (siq_fair), kept by a reset.
-- margin (absent means 0; model.set_limits): the queue's margin, already added to interval_us
-- and (with a quota) to window_us, the spacing and window in force; siq_declared takes it out.
-- pend_us and pend_due (absent means 0): a start whose body has not reported that it began
-- (model.QueueState.pending_us, began.lua): until when later starts wait for it (minus its
-- authorization once it reported), and the last slot used before it plus the interval then.

local function siq_now(arg)
  if arg ~= nil and arg ~= '' then
    return tonumber(arg)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local SIQ_NUMBERS = {'interval_us', 'ticket', 'current', 'anchor_us', 'last_start_us', 'paused'}

-- Returns (state, nil), (nil, nil) when the queue has no state, or (nil, error text)
-- when a field holds something siq_celery did not write.
local function siq_load(key)
  local raw = redis.call('HMGET', key, 'epoch', 'interval_us', 'ticket', 'current',
                         'anchor_us', 'last_start_us', 'paused', 'started_us', 'held_until_us',
                         'until_us', 'idle_us', 'burst', 'quota', 'window_us', 'w_used', 'conc', 'pend_us',
                         'pend_due', 'margin')
  local present = false
  for i = 1, 7 do
    if raw[i] then present = true end
  end
  if not present then return nil, nil end
  if not raw[1] or raw[1] == '' then
    return nil, 'SIQCORRUPT epoch ' .. tostring(raw[1])
  end
  local s = {epoch = raw[1]}
  for i, name in ipairs(SIQ_NUMBERS) do
    local v = tonumber(raw[i + 1])
    if v == nil or v ~= math.floor(v) then
      return nil, 'SIQCORRUPT ' .. name .. ' ' .. tostring(raw[i + 1])
    end
    s[name] = v
  end
  if s.interval_us <= 0 then return nil, 'SIQCORRUPT interval_us ' .. raw[2] end
  if s.paused ~= 0 and s.paused ~= 1 then return nil, 'SIQCORRUPT paused ' .. raw[7] end
  s.started_us = tonumber(raw[8]) or 0
  s.held_until_us = tonumber(raw[9]) or 0
  s.until_us, s.idle_us = tonumber(raw[10]) or 0, tonumber(raw[11]) or 0
  s.burst, s.quota, s.window_us = tonumber(raw[12]) or 0, tonumber(raw[13]) or 0, tonumber(raw[14]) or 0
  s.w_used = tonumber(raw[15]) or 0
  s.concurrency = tonumber(raw[16]) or 0
  s.pending_us, s.pending_due_us = tonumber(raw[17]) or 0, tonumber(raw[18]) or 0
  s.margin_us = tonumber(raw[19]) or 0
  return s, nil
end

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

-- A state created from nothing forgets the window's starts, as it forgets its last start.
local function siq_new_window(wkey)
  redis.call('DEL', wkey)
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

local function siq_save(key, s)
  redis.call('HSET', key, 'epoch', s.epoch, 'interval_us', s.interval_us, 'ticket', s.ticket,
             'current', s.current, 'anchor_us', s.anchor_us, 'last_start_us', s.last_start_us,
             'paused', s.paused, 'started_us', s.started_us, 'held_until_us', s.held_until_us,
             'until_us', s.until_us, 'idle_us', s.idle_us, 'burst', s.burst, 'quota', s.quota,
             'window_us', s.window_us, 'w_used', s.w_used, 'conc', s.concurrency, 'pend_us', s.pending_us,
             'pend_due', s.pending_due_us, 'margin', s.margin_us)
end

-- How long before its slot a start whose body reports may be authorized (model.start_lead_us).
local function siq_start_lead(s)
  return math.min(math.floor(s.interval_us / 4), 5000)
end

-- How long a start whose slot came waits before asking again while the last start's body
-- has not reported (model.pending_wait): a quarter interval, 0.5 to 5 ms, never past expiry.
local function siq_pending_wait(s, now)
  return math.max(math.min(math.max(math.floor(s.interval_us / 4), 500), 5000, s.pending_us - now), 1)
end

-- The flat reply shared by the control scripts: state fields, the store time, then the
-- times only the status shows, then the limits (15 values: redis.py STATE_REPLY).
local function siq_reply(s, now)
  return {s.epoch, s.interval_us, s.ticket, s.current, s.anchor_us, s.last_start_us,
          s.paused, now, s.started_us, s.held_until_us, s.burst, s.quota, s.window_us, s.concurrency,
          s.margin_us}
end

-- The rate cap (model.py: cap): GCRA's theoretical arrival time less the burst tolerance.
local function siq_cap(s)
  return s.last_start_us + s.interval_us - s.burst * s.interval_us
end

-- After an outage (no start, head overdue by more than max(10 intervals, 1 s), or than
-- overdue if longer: a release passes its horizon) the backlog shifts once so the head is
-- due max(10 intervals, 1 s) from now (model.py: shift_after_outage).
-- held: when the window quota lets the head start (a head the window holds is not late).
local function siq_shift_after_outage(s, now, overdue, held)
  local settle = math.max(10 * s.interval_us, 1000000)
  if s.anchor_us > s.last_start_us + s.interval_us then return false end  -- shifted already
  if math.max(s.anchor_us + s.interval_us, held or 0) >= now - math.max(settle, overdue) then return false end
  s.anchor_us = now + settle - s.interval_us
  return true
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

-- Idle expiry (per-key queues): every key in keys expires ttl_us after the queue's last
-- commitment (below), counted from now, unless it is paused or holds parked tasks, or tasks
-- waiting in its fair lines (those outlive any idle time: the keys are made persistent).
-- keys: the queue's keys, every one of which gets the expiry; read here are keys[1] the
-- state hash (idle_us is written there), keys[4] and keys[6] its parked tasks not leased and
-- leased (QueueKeys.all order: state, finished, ledger, parked, parked messages, releasing,
-- intervals, refused, unfinished, window, leases, fair) and, if given, keys[11] its leases
-- and keys[12] its fair keys with waiting tasks (siq_fair; the fair lines and the fair
-- shares' other keys never get an expiry, and each is gone once it is empty). s: the state
-- (nil: none or corrupt). ttl_us <= 0: the state's own idle_us; with none either, nothing expires.
-- now: the store time. The idle time is kept in the state (idle_us), so a script whose caller does
-- not know it (an operator's reset or override) passes 0 and the queue's own is used.
local function siq_touch(keys, s, ttl_us, now)
  if (not ttl_us or ttl_us <= 0) and s ~= nil then ttl_us = s.idle_us end
  if not ttl_us or ttl_us <= 0 then return end
  if s ~= nil and s.idle_us ~= ttl_us then
    s.idle_us = ttl_us
    redis.call('HSET', keys[1], 'idle_us', ttl_us)
  end
  local pin = (s ~= nil and s.paused == 1)
    or redis.call('EXISTS', keys[4]) == 1 or redis.call('EXISTS', keys[6]) == 1
    or (keys[12] ~= nil and redis.call('EXISTS', keys[12]) == 1)
  -- Idle means after the queue's last commitment: the last issued ticket's slot, a cost's
  -- or a back-off's hold. Keys that vanished before it would let a new life start early.
  local keep = ttl_us
  if s ~= nil then
    local busy = math.max(s.last_start_us + s.interval_us,
                          s.anchor_us + math.max(s.ticket - s.current, 0) * s.interval_us)
    if s.quota > 0 then busy = math.max(busy, s.started_us + s.window_us) end  -- the window's starts
    if keys[11] then  -- the leases: the keys outlive the bodies still running
      local last = redis.call('ZRANGE', keys[11], -1, -1, 'WITHSCORES')
      if #last > 0 then busy = math.max(busy, tonumber(last[2])) end
    end
    keep = math.max(keep, busy - now + ttl_us)
  end
  for i = 1, #keys do
    if pin then
      redis.call('PERSIST', keys[i])
    else
      redis.call('PEXPIRE', keys[i], math.max(math.floor(keep / 1000), 1))
    end
  end
end

-- The window quota (model.py: WindowUnits). The queue's window is a sorted set of its
-- starts, score = store time, member '<n>:<cost>'; s.w_used sums their costs. A reader
-- sees the window's cost units as one sequence: the units kept (1 .. m, oldest first), then
-- the units of the tickets in line (m + j: ticket current + j), each estimated at the later
-- of its interval slot and the time the unit quota places before it leaves the window.
-- n numbers the units: the units the window counted up to and including this start (the
-- state's w_cum: the newest start's n), 16 digits with leading zeros so that starts at one
-- time sort as they came. In time order n grows by each start's cost, so the start holding
-- a unit is found by bisection (siq_unit_time) and the units that left by the last start
-- that left, never by reading every start: a full window of 20,000 starts, one of them of
-- cost 2, is not read whole on every decision. A window written otherwise (by a version
-- that numbered the starts one by one, w_seq; or a start recorded out of time order) is
-- numbered anew once (siq_window_number): by the first write that needs its numbers, or by
-- the next start (a window whose starts all cost 1 is read by rank and needs none).
local function siq_member_cost(member)
  return tonumber(string.sub(member, string.find(member, ':', 1, true) + 1))
end

-- A member's n and cost; n is nil unless the member is numbered by units.
local function siq_member_units(member)
  local colon = string.find(member, ':', 1, true)
  if colon ~= 17 then return nil, tonumber(string.sub(member, colon + 1)) end
  return tonumber(string.sub(member, 1, 16)), tonumber(string.sub(member, 17 + 1))
end

local function siq_member(n, units)
  return string.format('%016.0f:%.0f', n, units)
end

-- The units counted before the first start kept, if the window is numbered by units and
-- agrees with the state: the oldest and the newest start bound the units kept (w_used), the
-- newest is w_cum. nil: it is not (siq_window_number).
local function siq_window_base(wkey, skey, s)
  local cum = tonumber(redis.call('HGET', skey, 'w_cum'))
  if cum == nil then return nil end
  local first = redis.call('ZRANGE', wkey, 0, 0)
  if #first == 0 then
    if s.w_used == 0 then return cum end
    return nil
  end
  local n1, c1 = siq_member_units(first[1])
  local n2 = siq_member_units(redis.call('ZRANGE', wkey, -1, -1)[1])
  if n1 == nil or n2 == nil or n2 ~= cum or n2 - (n1 - c1) ~= s.w_used then return nil end
  return n1 - c1
end

-- Number the window's starts by units, oldest first (once: a window an earlier version
-- wrote, or one a start out of time order left unordered), and recount w_used from them.
-- The numbers go on above every number in the window, so no new member is an old one, and
-- each start is added again before it is removed, so the key keeps its expiry. Returns the
-- units counted before the first start kept.
local function siq_window_number(wkey, skey, s)
  local all = redis.call('ZRANGE', wkey, 0, -1, 'WITHSCORES')
  local base = tonumber(redis.call('HGET', skey, 'w_cum')) or 0
  for j = 1, #all, 2 do
    local n = tonumber(string.sub(all[j], 1, string.find(all[j], ':', 1, true) - 1)) or 0
    if n > base then base = n end
  end
  local n, new, old = base, {}, {}
  for j = 1, #all, 2 do
    local units = siq_member_cost(all[j])
    n = n + units
    new[#new + 1] = all[j + 1]  -- the score as Redis wrote it
    new[#new + 1] = siq_member(n, units)
    old[#old + 1] = all[j]
    if #old >= 1000 or j + 1 >= #all then
      redis.call('ZADD', wkey, unpack(new))
      redis.call('ZREM', wkey, unpack(old))
      new, old = {}, {}
    end
  end
  s.w_used = n - base
  redis.call('HSET', skey, 'w_cum', n, 'w_used', s.w_used)
  return base
end

-- The number n of the start at rank (memoized per read).
local function siq_rank_units(u, rank)
  local n = u.ranks[rank]
  if n == nil then
    n = siq_member_units(redis.call('ZRANGE', u.key, rank, rank)[1])
    u.ranks[rank] = n
  end
  return n
end

-- When the unit-th cost unit kept started (oldest first): by rank when every start cost 1
-- (u.ones), else by bisection on the numbers (u.base: the units before the first start kept;
-- nil: a window not numbered by units, read whole). u.card: the starts in the window; u.skip:
-- the starts (members) before the first one kept, that a read only hides.
local function siq_unit_time(u, unit)
  if u.ones then
    local rank = unit - 1 + u.skip
    return tonumber(redis.call('ZRANGE', u.key, rank, rank, 'WITHSCORES')[2])
  end
  if u.base then  -- the first start whose number reaches the unit: every start holds 1 .. quota units
    local want = u.base + unit
    local lo = u.skip + math.ceil(unit / u.s.quota) - 1
    local hi = math.min(u.skip + unit - 1, u.card - 1)
    if lo > hi or siq_rank_units(u, hi) < want then return nil end
    while lo < hi do
      local mid = math.floor((lo + hi) / 2)
      if siq_rank_units(u, mid) >= want then hi = mid else lo = mid + 1 end
    end
    return tonumber(redis.call('ZRANGE', u.key, lo, lo, 'WITHSCORES')[2])
  end
  if not u.list then u.list = redis.call('ZRANGE', u.key, u.skip, -1, 'WITHSCORES') end
  for j = 1, #u.list, 2 do
    unit = unit - siq_member_cost(u.list[j])
    if unit <= 0 then return tonumber(u.list[j + 1]) end
  end
  return nil
end

-- The window forgets the starts at or before this time (model.window_cutoff): those that
-- left it, but not the last start while its body may still report that it began.
local function siq_window_cutoff(s, now)
  local cutoff = now - s.window_us
  if s.pending_us ~= 0 then return math.min(cutoff, s.started_us - 1) end
  return cutoff
end

-- Read the window at now (nil without a quota): forget the starts that left it, and when
-- the window held the head until one of them left, the line is due from then (the anchor
-- moves; written to the state hash at once, as is w_used). A window whose starts all cost 1
-- is read by rank (as many starts as units: its numbers are not read); one with a costlier
-- start by its numbers, checked first (siq_window_base) and numbered anew if need be.
local function siq_units(wkey, skey, s, now)
  if s.quota <= 0 then return nil end
  local card = redis.call('ZCARD', wkey)
  if s.w_used > 0 and card == 0 then  -- its starts expired: none to count
    s.w_used = 0
    redis.call('HSET', skey, 'w_used', 0)
  end
  local u = {key = wkey, s = s, times = {}, skip = 0, card = card, ones = card == s.w_used, ranks = {}}
  if not u.ones then
    u.base = siq_window_base(wkey, skey, s)
    if u.base == nil then
      u.base = siq_window_number(wkey, skey, s)
      u.ones = card == s.w_used
    end
  end
  local cutoff = now - s.window_us
  local unit = s.w_used + 1 - s.quota
  if unit >= 1 then
    local left = siq_unit_time(u, unit)
    if left and left <= cutoff then
      s.anchor_us = math.max(s.anchor_us, left + s.window_us - s.interval_us)
      redis.call('HSET', skey, 'anchor_us', s.anchor_us)
    end
  end
  cutoff = siq_window_cutoff(s, now)
  local gone = redis.call('ZCOUNT', wkey, '-inf', cutoff)
  if gone > 0 then
    local units = gone
    if not u.ones then  -- the units up to the last start that left
      local n = siq_member_units(redis.call('ZRANGE', wkey, gone - 1, gone - 1)[1])
      units, u.base = n - u.base, n
    end
    redis.call('ZREMRANGEBYSCORE', wkey, '-inf', cutoff)
    s.w_used = math.max(s.w_used - units, 0)
    redis.call('HSET', skey, 'w_used', s.w_used)
    u.card, u.ranks = card - gone, {}
    u.ones = u.card == s.w_used
  end
  u.m = s.w_used
  return u
end

-- The cost units of the window's 'gone' oldest starts, as siq_units_read reads the window
-- (by its numbers from u.base, by rank when all cost 1, else summed).
local function siq_units_gone(u, wkey, gone)
  if gone <= 0 then return 0 end
  if u.base then return siq_member_units(redis.call('ZRANGE', wkey, gone - 1, gone - 1)[1]) - u.base end
  if u.ones then return gone end
  local units = 0
  for _, member in ipairs(redis.call('ZRANGE', wkey, 0, gone - 1)) do units = units + siq_member_cost(member) end
  return units
end

-- The window read at now without a write (model.status_window): siq_units on a copy of s,
-- hiding the starts that left the window instead of forgetting them; nil without a quota.
-- skey: the state hash (its w_cum). A window not numbered by units is read whole
-- (numbering it is a write). u.used: the units started in the window ending now (the
-- status's use; the last start kept while its body may report is not counted once older).
local function siq_units_read(wkey, skey, s, now)
  if s.quota <= 0 then return nil end
  local c = {}
  for k, v in pairs(s) do c[k] = v end
  local card = redis.call('ZCARD', wkey)
  if c.w_used > 0 and card == 0 then c.w_used = 0 end  -- its starts expired
  local u = {key = wkey, s = c, times = {}, skip = 0, card = card, ones = card == c.w_used, ranks = {}}
  if not u.ones then u.base = siq_window_base(wkey, skey, c) end
  local cutoff = now - c.window_us
  local unit = c.w_used + 1 - c.quota
  if unit >= 1 then
    local left = siq_unit_time(u, unit)
    if left and left <= cutoff then c.anchor_us = math.max(c.anchor_us, left + c.window_us - c.interval_us) end
  end
  u.used = math.max(c.w_used - siq_units_gone(u, wkey, redis.call('ZCOUNT', wkey, '-inf', cutoff)), 0)
  local gone = redis.call('ZCOUNT', wkey, '-inf', siq_window_cutoff(c, now))
  if gone > 0 then
    local units = siq_units_gone(u, wkey, gone)
    if u.base then
      u.base = u.base + units
    elseif not u.ones then
      u.list = nil
    end
    c.w_used = math.max(c.w_used - units, 0)
    u.skip, u.ranks = gone, {}
    u.ones = card - gone == c.w_used
  end
  u.m = c.w_used
  return u
end

-- When unit 'unit' of the sequence starts (nil: before the first unit kept).
local function siq_unit_at(u, unit)
  if unit < 1 then return nil end
  if unit <= u.m then return siq_unit_time(u, unit) end
  local s, chain = u.s, {}
  while unit > u.m and u.times[unit] == nil do  -- down the chain, a quota at a time
    table.insert(chain, unit)
    unit = unit - s.quota
  end
  local below
  if unit > u.m then below = u.times[unit] else below = siq_unit_at(u, unit) end
  for k = #chain, 1, -1 do
    local v = chain[k]
    local spacing = math.max(s.anchor_us + (v - u.m) * s.interval_us, siq_cap(s))
    if below == nil then below = spacing else below = math.max(spacing, below + s.window_us) end
    u.times[v] = below
  end
  return below
end

-- When the window lets ticket start with cost (0: now): the unit quota places before its
-- last unit must have left, counting the tickets ahead of it; and in any case the window
-- must hold its own cost.
local function siq_window_slot(u, ticket, cost)
  if u == nil then return 0 end
  local s = u.s
  local units = math.min(cost, s.quota)
  local ahead = 0
  if ticket > s.current then ahead = ticket - s.current - 1 end
  local hard = siq_unit_at(u, u.m + units - s.quota)
  local line = siq_unit_at(u, u.m + ahead + units - s.quota)
  local slot = 0
  if hard then slot = hard + s.window_us end
  if line then slot = math.max(slot, line + s.window_us) end
  return slot
end

-- The concurrency cap (model.py: read_leases, release_shift, lease_wait, give_back): the
-- queue's leases are a sorted set, member = lease (task id and a token), score = expiry.
-- A lease came back at 'at' while the cap was full: a head due before then was held by the
-- cap, and the line is due from the release (the anchor moves; written at once).
local function siq_release_shift(skey, s, at)
  if s.ticket > s.current and s.anchor_us + s.interval_us < at then
    s.anchor_us = at - s.interval_us
    redis.call('HSET', skey, 'anchor_us', s.anchor_us)
  end
end

-- The live leases at now: the expired ones are forgotten; if that brought a full cap below
-- it, the release happened at the expiry that did. s may be nil (no state).
local function siq_read_leases(lkey, skey, s, now)
  local before = redis.call('ZCARD', lkey)
  if before == 0 then return 0 end
  local gone = redis.call('ZCOUNT', lkey, '-inf', now)
  if gone == 0 then return before end
  local n = 0
  if s then n = s.concurrency end
  if n > 0 and before >= n and n > before - gone then
    local freed = redis.call('ZRANGEBYSCORE', lkey, '-inf', now, 'WITHSCORES', 'LIMIT', before - n, 1)
    siq_release_shift(skey, s, tonumber(freed[2]))
  end
  redis.call('ZREMRANGEBYSCORE', lkey, '-inf', now)
  return before - gone
end

local SIQ_LEASE_POLL_US = 10000  -- model.LEASE_POLL_US

local function siq_lease_wait(lkey, now)
  local first = redis.call('ZRANGE', lkey, 0, 0, 'WITHSCORES')
  local earliest = now + SIQ_LEASE_POLL_US
  if #first > 0 then earliest = tonumber(first[2]) end
  return math.max(math.min(SIQ_LEASE_POLL_US, earliest - now), 1)
end

-- The end of a body gives its lease back (in the finish's own step); 1 if it was kept.
local function siq_give_back(lkey, skey, s, member, now)
  local count = siq_read_leases(lkey, skey, s, now)
  local kept = redis.call('ZREM', lkey, member)
  if kept == 1 and s and s.concurrency > 0 and count >= s.concurrency then
    siq_release_shift(skey, s, now)
  end
  return kept
end

-- Wake the queue's waiters (a lease given back under a cap): publish the next
-- ticket in line and the store's time on the queue's wake channel (keys.py: wake), which a
-- waiter holding that ticket or an earlier one reads (backends/redis.py: Wakes). A user
-- without the channel's permission (ACL) publishes nothing: its waiters poll, as before.
local function siq_wake(channel, s, now)
  if channel and channel ~= '' and s then
    redis.pcall('PUBLISH', channel, string.format('%.0f %.0f', s.current + 1, now))
  end
end

-- The live leases at now of a queue with a concurrency cap, 0 without one (reads the leases).
local function siq_live(lkey, skey, s, now)
  if s.concurrency <= 0 then return 0 end
  return siq_read_leases(lkey, skey, s, now)
end

local SIQ_LEASE_GRACE_US = 2 * SIQ_LEASE_POLL_US  -- model.LEASE_GRACE_US

-- When ticket may take one of the free leases, as far as the tickets ahead of it in line go
-- (model.lease_turn; 0: now): each ticket ahead keeps a claim on a lease until
-- SIQ_LEASE_GRACE_US after its slot, and ticket takes a lease only if one is left over for
-- each claim still held (live: the leases taken).
local function siq_lease_turn(s, ticket, live)
  local ahead = ticket - s.current - 1
  if s.concurrency <= 0 or ticket == 0 or ahead <= 0 then return 0 end
  local claims = ahead - (s.concurrency - live - 1)
  if claims <= 0 then return 0 end
  return math.max(s.anchor_us + claims * s.interval_us, siq_cap(s)) + SIQ_LEASE_GRACE_US
end

-- May ticket start now (model.decide; ticket 0 is FREE: no place in the line, the next
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

-- A start recorded in the window wkey at from began at to (model.Window.move: a re-stamp, or
-- a body's report): the latest start recorded then moves (members sort by their number).
local function siq_window_move(wkey, from, to)
  local at = redis.call('ZRANGEBYSCORE', wkey, from, from)
  if #at == 0 then return end
  local newest, seq = at[1], -1
  for _, member in ipairs(at) do
    local n = tonumber(string.sub(member, 1, string.find(member, ':', 1, true) - 1))
    if n > seq then newest, seq = member, n end
  end
  redis.call('ZADD', wkey, to, newest)
end

-- Record an authorized start (model.commit_start): the line continues from it (a late
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

-- The expiry of the live lease of a run of task_id in lkey (model.running_copy), or nil: a
-- copy of that task still runs, and another copy is answered 'running'.
local function siq_running(lkey, task_id, now)
  if task_id == '' then return nil end
  local expires = tonumber(redis.call('ZSCORE', lkey, task_id))
  if expires and expires > now then return expires end
  return nil
end

-- Who took a run's lease (model.RunOwner): the token of the call that asked (one per
-- wait_in_line call, sent with each of its asks) and the start it was given, kept in the
-- queue's parked messages hash (QueueKeys.parked_messages, whose fields are parked task ids:
-- these are named SIQ_RUN_OWNER .. task id, which no task id is), value
-- '<start>|<slot>|<token>'. Written when the run's lease is taken (dropped when it is taken
-- without a token), dropped when it is given back (finish.lua); one whose lease expired is
-- never read (siq_own_start asks for a live lease) and is overwritten by the next start.
local SIQ_RUN_OWNER = '\0run:'

local function siq_set_owner(mkey, task_id, token, now, slot)
  if token == '' then
    redis.call('HDEL', mkey, SIQ_RUN_OWNER .. task_id)
  else
    redis.call('HSET', mkey, SIQ_RUN_OWNER .. task_id, string.format('%.0f|%.0f|', now, slot) .. token)
  end
end

-- The start the call holding token was given already (model.own_start): its time and slot,
-- if the run of task_id holds a live lease in lkey that this call took; else nil.
local function siq_own_start(mkey, lkey, task_id, token, now)
  if token == '' or not siq_running(lkey, task_id, now) then return nil end
  local v = redis.call('HGET', mkey, SIQ_RUN_OWNER .. task_id)
  if not v then return nil end
  local a = string.find(v, '|', 1, true)
  local b = a and string.find(v, '|', a + 1, true)
  if not b or string.sub(v, b + 1) ~= token then return nil end
  return tonumber(string.sub(v, 1, a - 1)), tonumber(string.sub(v, a + 1, b - 1))
end

-- A start in the ledger stream (e=s). Short field names: a stream keeps them per entry.
-- c: the start's cost (an entry written before it was recorded reads as 1). The limits in
-- force (ledger.py, schema 3), each only when not 0: b burst, q quota, w window_us,
-- k concurrency; with a lease taken, lt its time to live and l its tag (siq_lease_tag); a
-- fair task's share (schema 4; fair = {key, tag, weight}, key '' none): fk, ft, fw.
local function siq_lease_tag(task_id, member)
  local prefix = task_id .. ':'
  if task_id ~= '' and string.sub(member, 1, #prefix) == prefix then return string.sub(member, #prefix + 1) end
  return member
end

local function siq_ledger_start(key, cap, s, ticket, task_id, slot, now, name, host, pid, deferrals, cost, lease,
                                lease_ttl, fair)
  if cap <= 0 then return end
  local entry = {'e', 's', 'ep', s.epoch, 't', ticket, 'id', task_id, 'n', name, 'sl', slot, 'st', now,
                 'iv', s.interval_us, 'h', host, 'p', pid, 'd', deferrals, 'c', cost}
  for _, f in ipairs({{'b', s.burst}, {'q', s.quota}, {'w', s.window_us}, {'k', s.concurrency}}) do
    if f[2] ~= 0 then
      table.insert(entry, f[1])
      table.insert(entry, f[2])
    end
  end
  if lease and lease ~= '' and s.concurrency > 0 then  -- a run's lease without a cap: not the audit's
    table.insert(entry, 'lt')
    table.insert(entry, lease_ttl)
    table.insert(entry, 'l')
    table.insert(entry, siq_lease_tag(task_id, lease))
  end
  if fair and fair[1] and fair[1] ~= '' then  -- a fair task: its key, tag and weight
    for i, name in ipairs({'fk', 'ft', 'fw'}) do
      table.insert(entry, name)
      table.insert(entry, fair[i])
    end
  end
  redis.call('XADD', key, 'MAXLEN', '~', cap, '*', unpack(entry))
end

-- Starts without a finish, per task id (model.py: too_many_lost): a sorted set of task
-- ids, each scored with the time of its last authorized start (microseconds, rounded
-- down to the millisecond) plus the count (at most 999): one score both orders them by
-- age (trimmed like the finished records) and carries the count. A finish removes it.
local function siq_unfinished(key, task_id, now, retention)
  local score = tonumber(redis.call('ZSCORE', key, task_id))
  if not score or math.floor(score / 1000) * 1000 < now - retention then return 0 end
  return score % 1000
end

local function siq_count_unfinished(key, task_id, now, retention, most)
  local n = math.min(siq_unfinished(key, task_id, now, retention) + 1, 999)
  redis.call('ZADD', key, math.floor(now / 1000) * 1000 + n, task_id)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', math.floor((now - retention) / 1000) * 1000 - 1)
  local kept = redis.call('ZCARD', key)
  if kept > most then redis.call('ZREMRANGEBYRANK', key, 0, kept - most - 1) end
end

-- The counters of authorized starts (model.start_counts), in the queue's counts hash
-- (QueueKeys.refused, beside the counts of refused starts), in the start's own script:
-- starts, deferrals, gaps (closer than the interval less 1 ms to the last start counted,
-- kept in last_us), late_us (lateness against the slot, summed) and late:<i>, the starts
-- in lateness bucket i (0-based; #SIQ_LATENESS_BUCKETS: past the last bound).
local SIQ_LATENESS_BUCKETS = {500, 1000, 2000, 5000, 10000, 25000, 50000, 100000, 250000, 500000,
                              1000000, 2500000, 5000000, 10000000}  -- model.LATENESS_BUCKETS_US

local function siq_count_start(key, now, slot, interval, deferrals)
  local late = math.max(0, now - slot)
  local bucket = #SIQ_LATENESS_BUCKETS
  for i, bound in ipairs(SIQ_LATENESS_BUCKETS) do
    if late <= bound then bucket = i - 1; break end
  end
  local last = tonumber(redis.call('HGET', key, 'last_us'))
  redis.call('HINCRBY', key, 'starts', 1)
  redis.call('HINCRBY', key, 'late_us', late)
  redis.call('HINCRBY', key, 'late:' .. bucket, 1)
  if deferrals > 0 then redis.call('HINCRBY', key, 'deferrals', deferrals) end
  if last and now - last < interval - 1000 then redis.call('HINCRBY', key, 'gaps', 1) end
  redis.call('HSET', key, 'last_us', now)
end

-- Where the interval and the limits come from (model.py: declare, override,
-- override_limits, effective_interval, effective_limits): a hash with declared_us,
-- declared_by, declared_at_us, override_us, override_by, override_at_us; the declared
-- limits declared_burst, declared_quota, declared_window_us, declared_conc (absent: none
-- declared, or by an earlier version); the limits override, one field per kind set
-- (override_burst; override_quota with override_window_us; override_conc; absent: that
-- kind not overridden), limits_by and limits_at_us; and per live worker node
-- 'n:<node>' (its declared interval), 'e:<node>' (when its declaration expires unless
-- renewed) and its declared limits 'b:<node>', 'q:<node>', 'w:<node>', 'c:<node>' (absent:
-- a node of an earlier version, which declares none). Returns the fields as a table,
-- nodes in .nodes (node -> {interval, expires, limits or nil}), the declared limits in
-- .declared_limits (nil: none), the override in .override (kind -> value, nil: not
-- overridden), dropping expired nodes from the table (and, with prune, from the hash). A
-- field that holds no whole number where one belongs reads as 0 (a node's interval: the
-- node is dropped); each is listed in .unreadable as 'field value', for the caller's log
-- (the next save of the sources drops it).
local SIQ_TEXT_FIELDS = {declared_by = true, override_by = true, limits_by = true}
local SIQ_NODE_LIMITS = {['b:'] = 'burst', ['q:'] = 'quota', ['w:'] = 'window_us', ['c:'] = 'concurrency',
                         ['m:'] = 'margin_us'}

local function siq_node_fields(node)
  return 'n:' .. node, 'e:' .. node, 'b:' .. node, 'q:' .. node, 'w:' .. node, 'c:' .. node, 'm:' .. node
end

local function siq_sources(key, now, prune)
  local raw = redis.call('HGETALL', key)
  local src = {declared_us = 0, declared_by = '', declared_at_us = 0,
               override_us = 0, override_by = '', override_at_us = 0, limits_by = '', limits_at_us = 0,
               nodes = {}, unreadable = {}}
  local intervals, expires, limits, fields = {}, {}, {}, {}
  for i = 1, #raw, 2 do
    local f, v = raw[i], raw[i + 1]
    local kind, node = string.sub(f, 1, 2), string.sub(f, 3)
    if SIQ_TEXT_FIELDS[f] then
      src[f] = v
    else
      local number = tonumber(v)
      if number == nil or number ~= math.floor(number) or number < 0 then
        table.insert(src.unreadable, f .. ' ' .. v)
        number = 0
      end
      if kind == 'n:' then intervals[node] = number
      elseif kind == 'e:' then expires[node] = number
      elseif SIQ_NODE_LIMITS[kind] then
        limits[node] = limits[node] or {}
        limits[node][SIQ_NODE_LIMITS[kind]] = number
      else fields[f] = number end
    end
  end
  for _, f in ipairs({'declared_us', 'declared_at_us', 'override_us', 'override_at_us', 'limits_at_us'}) do
    if fields[f] then src[f] = fields[f] end
  end
  if fields.declared_burst then
    src.declared_limits = siq_limits(fields.declared_burst, fields.declared_quota, fields.declared_window_us,
                                     fields.declared_conc, fields.declared_margin)
  end
  src.override = {burst = fields.override_burst, concurrency = fields.override_conc, margin_us = fields.override_margin}
  if fields.override_quota then
    local q = siq_limits(0, fields.override_quota, fields.override_window_us, 0, 0)
    src.override.quota, src.override.window_us = q.quota, q.window_us
  end
  for node, interval in pairs(intervals) do
    local e = expires[node]
    if interval > 0 and e and e > now then
      local l = limits[node]
      if l and l.burst then l = siq_limits(l.burst, l.quota, l.window_us, l.concurrency, l.margin_us) else l = nil end
      src.nodes[node] = {interval, e, l}
    elseif prune then
      redis.call('HDEL', key, siq_node_fields(node))
    end
  end
  if prune then  -- an expiry or limits left without their interval
    for _, by_node in ipairs({expires, limits}) do
      for node, _ in pairs(by_node) do
        if not intervals[node] then redis.call('HDEL', key, siq_node_fields(node)) end
      end
    end
  end
  return src
end

-- The override if set, else the slowest live declaration, else the last declaration;
-- 0 if none (the stored interval stays).
local function siq_effective(src)
  if src.override_us > 0 then return src.override_us end
  local slowest = 0
  for _, d in pairs(src.nodes) do
    if d[1] > slowest then slowest = d[1] end
  end
  if slowest > 0 then return slowest end
  return src.declared_us
end

-- The limits at least as strict as each of a list (model.py: strictest): the smallest
-- burst; a quota if any has one, of the smallest N over the longest window among those;
-- the smallest concurrency cap among those with one.
local function siq_strictest(list)
  local burst, quota, window, cap, margin = nil, 0, 0, 0, 0
  for _, l in ipairs(list) do
    if l.margin_us > margin then margin = l.margin_us end
    if burst == nil or l.burst < burst then burst = l.burst end
    if l.quota > 0 then
      if quota == 0 or l.quota < quota then quota = l.quota end
      if l.window_us > window then window = l.window_us end
    end
    if l.concurrency > 0 and (cap == 0 or l.concurrency < cap) then cap = l.concurrency end
  end
  return siq_limits(burst, quota, window, cap, margin)
end

-- Kind by kind: the override if set, else the strictest live declaration (nodes of an
-- earlier version have no say), else the last declaration, else the state's own limits.
local function siq_effective_limits(src, s)
  local live = {}
  for _, d in pairs(src.nodes) do
    if d[3] then table.insert(live, d[3]) end
  end
  local base = src.declared_limits
  if #live > 0 then base = siq_strictest(live) end
  if base == nil then base = siq_declared(s) end
  local o = src.override
  local burst, quota, window, conc, margin = base.burst, base.quota, base.window_us, base.concurrency, base.margin_us
  if o.burst then burst = o.burst end
  if o.quota then quota, window = o.quota, o.window_us end
  if o.concurrency then conc = o.concurrency end
  if o.margin_us then margin = o.margin_us end
  return siq_limits(burst, quota, window, conc, margin)
end

-- When the earliest live node declaration expires (0: none live): the effective interval
-- may change then without any script declaring (siq_follow_expiry).
local function siq_until(src)
  local soonest = 0
  for _, d in pairs(src.nodes) do
    if soonest == 0 or d[2] < soonest then soonest = d[2] end
  end
  return soonest
end

-- The state runs at what its sources give (model.py: apply_sources): the effective interval
-- (none: the stored one stays) and limits; until_us follows the live declarations.
local function siq_apply_sources(src, s)
  local effective = siq_effective(src)
  if effective > 0 then s.interval_us = effective + s.margin_us end
  siq_set_limits(s, siq_effective_limits(src, s))
  s.until_us = siq_until(src)
end

-- The effective interval and limits follow the expiry of node declarations (model.py:
-- follow_expiry): once the earliest live declaration seen at the last recomputation
-- (s.until_us) has expired, they are recomputed from those still live. Every script that
-- decides by the interval calls it first, so a killed node's declaration stops counting
-- exactly siq_declaration_ttl after its last renewal, on the store's clock, whether or not
-- a live node declares in between. True if s changed (the caller saves it).
local function siq_follow_expiry(sources_key, s, now)
  if s.until_us == 0 or now < s.until_us then return false end
  siq_apply_sources(siq_sources(sources_key, now, true), s)
  return true
end

local function siq_save_sources(key, src)
  redis.call('HSET', key, 'declared_us', src.declared_us, 'declared_by', src.declared_by,
             'declared_at_us', src.declared_at_us, 'override_us', src.override_us,
             'override_by', src.override_by, 'override_at_us', src.override_at_us,
             'limits_by', src.limits_by, 'limits_at_us', src.limits_at_us)
  local d = src.declared_limits
  if d then
    redis.call('HSET', key, 'declared_burst', d.burst, 'declared_quota', d.quota,
               'declared_window_us', d.window_us, 'declared_conc', d.concurrency, 'declared_margin', d.margin_us)
  end
  local o = src.override
  if o.burst then redis.call('HSET', key, 'override_burst', o.burst)
  else redis.call('HDEL', key, 'override_burst') end
  if o.quota then redis.call('HSET', key, 'override_quota', o.quota, 'override_window_us', o.window_us)
  else redis.call('HDEL', key, 'override_quota', 'override_window_us') end
  if o.concurrency then redis.call('HSET', key, 'override_conc', o.concurrency)
  else redis.call('HDEL', key, 'override_conc') end
  if o.margin_us then redis.call('HSET', key, 'override_margin', o.margin_us)
  else redis.call('HDEL', key, 'override_margin') end
end

-- Limits as five reply values; -1 for each when there are none (nil).
local function siq_limits_reply(reply, l)
  if l then
    for _, v in ipairs({l.burst, l.quota, l.window_us, l.concurrency, l.margin_us}) do table.insert(reply, v) end
  else
    for _ = 1, 5 do table.insert(reply, -1) end
  end
end

-- The limits override as five reply values: each kind's, -1 for one not overridden (the
-- window: 0 then).
local function siq_override_reply(reply, o)
  table.insert(reply, o.burst or -1)
  table.insert(reply, o.quota or -1)
  table.insert(reply, o.window_us or 0)
  table.insert(reply, o.concurrency or -1)
  table.insert(reply, o.margin_us or -1)
end

-- The sources as a flat reply (redis.py: _sources): the six interval fields, the declared
-- limits (siq_limits_reply), the limits override (siq_override_reply), limits_by,
-- limits_at_us; then node, interval, expires and its five limits (siq_limits_reply) per
-- live node.
local function siq_sources_reply(src)
  local reply = {src.declared_us, src.declared_by, src.declared_at_us, src.override_us,
                 src.override_by, src.override_at_us}
  siq_limits_reply(reply, src.declared_limits)
  siq_override_reply(reply, src.override)
  table.insert(reply, src.limits_by)
  table.insert(reply, src.limits_at_us)
  for node, d in pairs(src.nodes) do
    table.insert(reply, node)
    table.insert(reply, d[1])
    table.insert(reply, d[2])
    siq_limits_reply(reply, d[3])
  end
  return reply
end

-- An operator's override written (set_interval, set_limits): the sources saved, the state
-- run at what they now give, saved and touched; the reply is the state (siq_reply), then each
-- unreadable field of the sources as 'field value'.
local function siq_commit_override(keys, s, src, idle_us, now)
  siq_save_sources(keys[7], src)
  siq_apply_sources(src, s)
  siq_save(keys[1], s)
  siq_touch(keys, s, idle_us, now)
  local reply = siq_reply(s, now)
  for _, field in ipairs(src.unreadable) do table.insert(reply, field) end
  return reply
end

-- Fair shares among keys under one limit (model.py: FairLines, fair_push, fair_next,
-- fair_promote; docs/design.md, "Fair shares"): start-time fair queuing. A queue's fair
-- lines, f = siq_fair(state key, QueueKeys.fair_keys): f.active, the fairness keys with
-- waiting tasks, a sorted set scored by the start tag of each one's head (equal tags order
-- by member: the smaller key first, as the model's ties); f.finish, the finish tags kept, a
-- sorted set; f.weight, a hash, key -> weight (the keys with waiting tasks); f.messages, a
-- hash, task id -> message of each waiting task; f.waiting, the keys with waiting tasks, a
-- sorted set scored by how many wait (who waits most: fair_backlog.lua); each key's line, a
-- list of '<cost>|<task id>' (siq_fair_line); the virtual time, field fair_v of the state hash
-- (absent: 0). Only what waits is kept: when no task waits, every one of them is empty
-- (Redis drops an empty key) and fair_v is gone. Tags are whole numbers, FAIR_SCALE per
-- cost unit of weight 1, far below 2^53 (the virtual time starts over when no key has work).
local SIQ_FAIR_SCALE = 720720  -- model.FAIR_SCALE
local SIQ_MAX_FAIR_WEIGHT = 1000  -- model.MAX_FAIR_WEIGHT
local SIQ_FAIR_LOOKAHEAD_US, SIQ_FAIR_LOOKAHEAD_MIN, SIQ_FAIR_LOOKAHEAD_MAX = 250000, 4, 64  -- model.FAIR_LOOKAHEAD_*

local function siq_fair(skey, keys)
  return {state = skey, active = keys[1], finish = keys[2], weight = keys[3], messages = keys[4], waiting = keys[5]}
end

-- The line of key: the active set's name, then the key in braces (QueueKeys.fair_line): in
-- the queue's hash slot (the first braces are the queue's), and no other queue's key has a
-- brace there. Not in KEYS (there is one per fairness key): built here, never expired.
local function siq_fair_line(f, key)
  return f.active .. '{' .. key .. '}'
end

-- A whole number from 1 to most (nil: any), or nil.
local function siq_whole(v, most)
  v = tonumber(v)
  if v == nil or v ~= math.floor(v) or v < 1 or (most and v > most) then return nil end
  return v
end

-- The FairLines of the model, one function each.
local function siq_fair_vtime(f)
  return tonumber(redis.call('HGET', f.state, 'fair_v')) or 0
end

local function siq_fair_set_vtime(f, v)
  if v == 0 then redis.call('HDEL', f.state, 'fair_v') else redis.call('HSET', f.state, 'fair_v', v) end
end

local function siq_fair_head_tag(f, key)
  return tonumber(redis.call('ZSCORE', f.active, key))
end

local function siq_fair_smallest(f)  -- tag, key of the active key with the smallest tag; nil: none
  local head = redis.call('ZRANGE', f.active, 0, 0, 'WITHSCORES')  -- O(log n) however many keys wait
  if #head == 0 then return nil end
  return tonumber(head[2]), head[1]
end

local function siq_fair_set_head_tag(f, key, tag)  -- tag nil: inactive
  if tag == nil then redis.call('ZREM', f.active, key) else redis.call('ZADD', f.active, tag, key) end
end

local function siq_fair_finish_tag(f, key)
  return tonumber(redis.call('ZSCORE', f.finish, key))
end

local function siq_fair_set_finish_tag(f, key, tag)
  redis.call('ZADD', f.finish, tag, key)
end

local function siq_fair_largest_finish_tag(f)
  local last = redis.call('ZRANGE', f.finish, -1, -1, 'WITHSCORES')
  if #last == 0 then return nil end
  return tonumber(last[2])
end

local function siq_fair_forget_finish_tags(f, through)
  redis.call('ZREMRANGEBYSCORE', f.finish, '-inf', through)
end

local function siq_fair_line_push(f, key, task_id, cost, weight)  -- FairLines.push
  local waiting = redis.call('RPUSH', siq_fair_line(f, key), string.format('%d|%s', cost, task_id))
  redis.call('HSET', f.weight, key, weight)
  redis.call('ZADD', f.waiting, waiting, key)  -- the line's length: right whatever was kept before
end

local function siq_fair_line_pop(f, key)  -- FairLines.pop: task id, cost, weight
  local line = siq_fair_line(f, key)
  local v = redis.call('LPOP', line)
  local bar = string.find(v, '|', 1, true)
  local weight = tonumber(redis.call('HGET', f.weight, key))
  local waiting = redis.call('LLEN', line)
  if waiting == 0 then
    redis.call('HDEL', f.weight, key)
    redis.call('ZREM', f.waiting, key)
  else
    redis.call('ZADD', f.waiting, waiting, key)
  end
  return string.sub(v, bar + 1), tonumber(string.sub(v, 1, bar - 1)), weight
end

local function siq_fair_waiting(f, key)
  return redis.call('LLEN', siq_fair_line(f, key))
end

-- A task of key waits for its share; a key with no work before joins now (model.fair_push).
local function siq_fair_push(f, key, task_id, cost, weight)
  if siq_fair_head_tag(f, key) == nil then
    siq_fair_set_head_tag(f, key, math.max(siq_fair_vtime(f), siq_fair_finish_tag(f, key) or 0))
  end
  siq_fair_line_push(f, key, task_id, cost, weight)
end

-- The next task to hand a ticket of the shared queue, taken from its line (model.fair_next):
-- key, task id, cost, the tag it is served at and its key's weight; nil when no key has work.
local function siq_fair_next(f)
  local tag, key = siq_fair_smallest(f)
  if tag == nil then return nil end
  local task_id, cost, weight = siq_fair_line_pop(f, key)
  local units = cost * SIQ_FAIR_SCALE
  local finish = tag + (units - math.fmod(units, weight)) / weight  -- exact: units // weight
  siq_fair_set_finish_tag(f, key, finish)
  if siq_fair_waiting(f, key) > 0 then siq_fair_set_head_tag(f, key, finish) else siq_fair_set_head_tag(f, key, nil) end
  -- The virtual time moves to the tag served; when no key has work left, nothing is kept
  -- and it starts over from 0.
  if siq_fair_smallest(f) == nil then
    siq_fair_forget_finish_tags(f, math.max(tag, siq_fair_largest_finish_tag(f) or 0))
    siq_fair_set_vtime(f, 0)
  else
    siq_fair_set_vtime(f, tag)
    siq_fair_forget_finish_tags(f, tag)
  end
  return key, task_id, cost, tag, weight
end

-- Tickets a fair queue keeps handed out ahead of its starts (model.fair_lookahead).
local function siq_fair_lookahead(interval, concurrency)
  local ahead = math.min(SIQ_FAIR_LOOKAHEAD_MAX,
    math.max(SIQ_FAIR_LOOKAHEAD_MIN, math.ceil(SIQ_FAIR_LOOKAHEAD_US / math.max(interval, 1))))
  if concurrency > 0 then ahead = math.min(ahead, concurrency + SIQ_FAIR_LOOKAHEAD_MIN) end
  return ahead
end

-- How many more tickets a fair queue may hand out now (model.fair_room): the lookahead less
-- those handed out and not started, unless the newest one's slot is more than the outage
-- span past with no start since (tickets that will never start must not hold it forever).
local function siq_fair_room(s, now)
  local ahead = siq_fair_lookahead(s.interval_us, s.concurrency)
  local handed = s.ticket - s.current
  if handed > 0 then
    local newest = math.max(s.anchor_us + handed * s.interval_us, siq_cap(s))
    if math.max(newest, s.last_start_us) + math.max(10 * s.interval_us, 1000000) < now then return ahead end
  end
  return ahead - handed
end

-- Hand tickets of the shared queue to the fair heads, in fair order, while fewer than the
-- lookahead are handed out and not yet started (model.fair_promote; s changes: the caller
-- saves it). A task of cost c claims c tickets (siq_claim: the window, if any, read at now
-- before). Returns {first ticket, task id, key, tag, weight} per task handed one; none
-- while paused.
local function siq_fair_promote(f, s, now)
  local promoted = {}
  if s.paused == 1 then return promoted end
  local room = siq_fair_room(s, now)
  while room > 0 do
    local key, task_id, cost, tag, weight = siq_fair_next(f)
    if key == nil then break end
    local first = siq_claim(s, cost, now)
    table.insert(promoted, {first, task_id, key, tag, weight})
    room = room - cost
  end
  return promoted
end

-- A promoted task's parked message with its fair share in front, for the ledger:
-- '{"fair": [key, tag, weight], ...' (messages.with_fair_share; parking.py reads it).
local function siq_fair_message(message, key, tag, weight)
  if string.sub(message, 1, 1) ~= '{' then return message end
  local rest = string.sub(message, 2)
  local sep = ', '
  if string.find(rest, '^%s*}') then sep = ' ' end
  return string.format('{"fair": [%s, %d, %d]%s%s', cjson.encode(key), tag, weight, sep, rest)
end
