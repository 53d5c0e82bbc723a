-- restamp: move the last start to now if it is still the caller's (its authorization
-- reply came back slowly, so its body starts later than the store recorded). Only ever
-- delays later starts. A queue with a burst is never re-stamped (line.restamp).
-- KEYS[1]  the queue's state hash
-- KEYS[2]  the queue's window (siq_units): with a quota the start moves there too
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  the caller's epoch
-- ARGV[3]  the last slot of the caller's authorized start, microseconds: its start, or for
--          a start of cost c, c - 1 intervals after it (line.restamp)
-- Returns the new start time, or 0 if the last start is no longer the caller's (or the
-- queue has a burst). The start and its last slot move by the same time.
local now = siq_now(ARGV[1])
local s, err = siq_load(KEYS[1])
if err then return redis.error_reply(err) end
local began = s and s.started_us
if not s or s.burst > 0 or s.epoch ~= ARGV[2] or s.last_start_us ~= tonumber(ARGV[3]) or now < began then
  return 0
end
if began <= 0 or began > s.last_start_us then  -- no start recorded: nothing to move
  return 0
end
s.last_start_us = s.last_start_us + (now - began)
s.started_us = now
s.anchor_us = math.max(s.anchor_us, s.last_start_us)
if s.quota > 0 then
  siq_window_move(KEYS[2], began, now)
end
siq_save(KEYS[1], s)
return now
