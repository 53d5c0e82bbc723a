-- The counters of authorized starts on the Redis store (part of the prelude: backends/redis_replies.py
-- PRELUDE): the starts, deferrals, gaps and lateness buckets of a queue.
-- twin: siq_celery/rules/counters.py

-- The counters of authorized starts (counters.start_counts), in the queue's counts hash
-- (QueueKeys.refused, beside the counts of refused starts), in the start's own script:
-- starts, deferrals, gaps (closer than the interval less 1 ms to the last start counted,
-- kept in last_us), late_us (lateness against the slot, summed) and late:<i>, the starts
-- in lateness bucket i (0-based; #SIQ_LATENESS_BUCKETS: past the last bound).
local SIQ_LATENESS_BUCKETS = {500, 1000, 2000, 5000, 10000, 25000, 50000, 100000, 250000, 500000,
                              1000000, 2500000, 5000000, 10000000}  -- counters.LATENESS_BUCKETS_US

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
