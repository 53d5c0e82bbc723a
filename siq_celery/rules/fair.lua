-- Fair shares on the Redis store (part of the prelude: backends/redis_replies.py PRELUDE): the fair
-- lines of a queue, a task pushed and the next one served, the lookahead of tickets handed to
-- the fair heads, and a promoted task's message.
-- twin: siq_celery/rules/fair.py

-- Fair shares among keys under one limit (fair.py: FairLines, fair_push, fair_next,
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
local SIQ_FAIR_SCALE = 720720  -- fair.FAIR_SCALE
local SIQ_MAX_FAIR_WEIGHT = 1000  -- fair.MAX_FAIR_WEIGHT
local SIQ_FAIR_LOOKAHEAD_US, SIQ_FAIR_LOOKAHEAD_MIN, SIQ_FAIR_LOOKAHEAD_MAX = 250000, 4, 64  -- fair.FAIR_LOOKAHEAD_*

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

-- A task of key waits for its share; a key with no work before joins now (fair.fair_push).
local function siq_fair_push(f, key, task_id, cost, weight)
  if siq_fair_head_tag(f, key) == nil then
    siq_fair_set_head_tag(f, key, math.max(siq_fair_vtime(f), siq_fair_finish_tag(f, key) or 0))
  end
  siq_fair_line_push(f, key, task_id, cost, weight)
end

-- The next task to hand a ticket of the shared queue, taken from its line (fair.fair_next):
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

-- Tickets a fair queue keeps handed out ahead of its starts (fair.fair_lookahead).
local function siq_fair_lookahead(interval, concurrency)
  local ahead = math.min(SIQ_FAIR_LOOKAHEAD_MAX,
    math.max(SIQ_FAIR_LOOKAHEAD_MIN, math.ceil(SIQ_FAIR_LOOKAHEAD_US / math.max(interval, 1))))
  if concurrency > 0 then ahead = math.min(ahead, concurrency + SIQ_FAIR_LOOKAHEAD_MIN) end
  return ahead
end

-- How many more tickets a fair queue may hand out now (fair.fair_room): the lookahead less
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
-- lookahead are handed out and not yet started (fair.fair_promote; s changes: the caller
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
