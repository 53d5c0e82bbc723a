-- renew: the bodies holding leases ARGV[3..] still run; each lease kept now expires
-- ARGV[2] microseconds from now (concurrency.py: renew_leases). One that expired is not taken
-- again: it is forgotten first (siq_read_leases, which may move a line the cap held).
-- KEYS[1..12]  the queue's keys (QueueKeys.all): KEYS[1] its state hash, KEYS[11] its leases;
--              all of them for idle expiry (the keys outlive the leases: siq_touch)
-- ARGV[1]  now in microseconds, or '' for Redis TIME
-- ARGV[2]  the leases' time to live (microseconds): siq_lease_timeout
-- Returns the number of leases renewed.
local now = siq_now(ARGV[1])
local s = siq_load(KEYS[1])  -- corrupt or missing state: the leases are renewed all the same
siq_read_leases(KEYS[11], KEYS[1], s, now)
local expires = now + tonumber(ARGV[2])
local renewed, seen = 0, {}
for i = 3, #ARGV do
  local member = ARGV[i]
  if not seen[member] and redis.call('ZSCORE', KEYS[11], member) then
    redis.call('ZADD', KEYS[11], 'XX', expires, member)
    renewed = renewed + 1
  end
  seen[member] = true
end
if s then siq_touch(KEYS, s, 0, now) end
return renewed
