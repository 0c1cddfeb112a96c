-- lapse_now.lua: make a live lease due for takeover now, as if its owner were gone
-- (an operator's and a test's action).
--
-- The lease is marked LAPSED with lapseReason "gone", not only given a past expiry: a
-- renewal after a real expiry is accepted (one Redis blip must not become a takeover), so an
-- owner that is in fact alive would renew a merely expired lease before the reaper's next
-- pass, and the takeover asked for would not happen. Its next renewal answers "lapsed"
-- instead, and the claim counts the takeover as cause "gone".
--
-- KEYS[1]  lease hash
-- KEYS[2]  expiry index
--
-- Returns {code}: "lapsed" | "not-live" | "missing"
local now = now_ms()
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return {'missing'}
end
if status ~= 'RUNNING' and status ~= 'STALLED' then
  return {'not-live'}
end
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('HSET', KEYS[1], 'status', 'LAPSED', 'leaseExpireAt', now, 'lapsedAt', now,
  'lapseReason', 'gone')
return {'lapsed'}
