-- expire.lua: make a live lease due for takeover now, as if its owner were gone
-- (an operator's and a test's action; the owner's next renewal still succeeds unless the
-- reaper claims the lease first, exactly as after a real expiry).
--
-- KEYS[1]  lease hash
-- KEYS[2]  expiry index
--
-- Returns {code}: "expired" | "not-live" | "missing"
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return {'missing'}
end
if status ~= 'RUNNING' and status ~= 'STALLED' then
  return {'not-live'}
end
redis.call('HSET', KEYS[1], 'leaseExpireAt', now)
redis.call('ZADD', KEYS[2], now, KEYS[1])
return {'expired'}
