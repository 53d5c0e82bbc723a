-- The window quota on the Redis store (part of the prelude: backends/redis_replies.py PRELUDE): the
-- window's starts as a sorted set numbered by cost units, read at now (siq_units, or
-- siq_units_read without a write), its cutoff, the slot it lets a ticket start at, and a start
-- moved in it.
-- twin: siq_celery/rules/window.py

-- A state created from nothing forgets the window's starts, as it forgets its last start.
local function siq_new_window(wkey)
  redis.call('DEL', wkey)
end

-- The window quota (window.py: WindowUnits). The queue's window is a sorted set of its
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
  if u.base then  -- the first start whose number reaches the unit: every start holds 1 unit or more
    local want = u.base + unit  -- (and may hold more than the quota in force: one lowered since)
    local lo = u.skip
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

-- The window forgets the starts at or before this time (window.window_cutoff): those that
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

-- The window read at now without a write (window.status_window): siq_units on a copy of s,
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

-- A start recorded in the window wkey at from began at to (window.Window.move: a re-stamp, or
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
