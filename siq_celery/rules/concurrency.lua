-- The concurrency cap on the Redis store (part of the prelude: backends/redis_replies.py PRELUDE): the
-- queue's leases, read at now, the line shifted by a release, a lease given back, the claims
-- of the tickets ahead on the free leases, and the run's lease of a task id with its owner.
-- twin: siq_celery/rules/concurrency.py

-- The concurrency cap (concurrency.py: read_leases, release_shift, lease_wait, give_back): the
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

local SIQ_LEASE_POLL_US = 10000  -- concurrency.LEASE_POLL_US

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

-- The live leases at now of a queue with a concurrency cap, 0 without one (reads the leases).
local function siq_live(lkey, skey, s, now)
  if s.concurrency <= 0 then return 0 end
  return siq_read_leases(lkey, skey, s, now)
end

local SIQ_LEASE_GRACE_US = 2 * SIQ_LEASE_POLL_US  -- concurrency.LEASE_GRACE_US

-- When ticket may take one of the free leases, as far as the tickets ahead of it in line go
-- (concurrency.lease_turn; 0: now): each ticket ahead keeps a claim on a lease until
-- SIQ_LEASE_GRACE_US after its slot, and ticket takes a lease only if one is left over for
-- each claim still held (live: the leases taken).
local function siq_lease_turn(s, ticket, live)
  local ahead = ticket - s.current - 1
  if s.concurrency <= 0 or ticket == 0 or ahead <= 0 then return 0 end
  local claims = ahead - (s.concurrency - live - 1)
  if claims <= 0 then return 0 end
  return math.max(s.anchor_us + claims * s.interval_us, siq_cap(s)) + SIQ_LEASE_GRACE_US
end

-- The expiry of the live lease of a run of task_id in lkey (concurrency.running_copy), or nil: a
-- copy of that task still runs, and another copy is answered 'running'.
local function siq_running(lkey, task_id, now)
  if task_id == '' then return nil end
  local expires = tonumber(redis.call('ZSCORE', lkey, task_id))
  if expires and expires > now then return expires end
  return nil
end

-- Who took a run's lease (concurrency.RunOwner): the token of the call that asked (one per
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

-- The start the call holding token was given already (concurrency.own_start): its time and slot,
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
