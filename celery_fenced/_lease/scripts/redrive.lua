-- redrive.lua: put an ABANDONED task back for a fresh set of takeovers.
--
-- The abandoned FAILURE is removed (clients see PENDING again) and the lease becomes
-- LAPSED and due now, so the next reaper pass re-sends the original call.
--
-- KEYS[1]  lease hash
-- KEYS[2]  Celery's result key
-- KEYS[3]  expiry index
-- KEYS[4]  dead letters (the task leaves them)
--
-- Returns {code, previous status}: "redriven" | "not-abandoned" | "missing"
local now = now_ms()
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  redis.call('ZREM', KEYS[4], KEYS[1])
  return {'missing', ''}
end
if status ~= 'ABANDONED' then
  return {'not-abandoned', status}
end
redis.call('ZREM', KEYS[4], KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('PERSIST', KEYS[1])
redis.call('ZADD', KEYS[3], now, KEYS[1])
redis.call('HSET', KEYS[1], 'status', 'LAPSED', 'takeovers', 0, 'leaseExpireAt', now,
  'lapsedAt', now, 'lapseReason', 'redrive')
return {'redriven', status}
