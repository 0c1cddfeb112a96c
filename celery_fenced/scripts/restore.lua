-- restore.lua: a live owner puts back its lease after the hash vanished from Redis.
--
-- An evicted key, a FLUSH, or a failover that lost writes can delete a lease while its owner
-- runs. The owner then writes it again, with the call it recorded, so the task is neither
-- lost (the reaper can still re-send it) nor stopped: it finishes under its own token.
--
-- KEYS[1]  lease hash
-- KEYS[2]  token counter
-- KEYS[3]  expiry index
-- KEYS[4]  Celery's result key
-- ARGV[1]  ownerId
-- ARGV[2]  ownerToken
-- ARGV[3]  lease ttl, ms
-- ARGV[4]  taskName
-- ARGV[5]  the original call (JSON), may be ""
-- ARGV[6]  attempt
-- ARGV[7]  takeovers
-- ARGV[8]  maxTakeovers
-- ARGV[9]  current stage, may be ""
--
-- Returns {code}:
--   "restored"  the lease is back, RUNNING for this owner, due at now + ttl
--   "exists"    a lease exists (another delivery acquired it meanwhile): nothing written
--   "finished"  the task finished under this token: its lease lives on in the result
--               (fence_of()), nothing written
--   "stale-token"  the task finished under another token: nothing written
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {'exists'}
end
local fence = finished_fence(KEYS[4])
if fence then
  if fence == ARGV[2] then
    return {'finished'}
  end
  return {'stale-token'}
end
local now = now_ms()
local token = tonumber(ARGV[2])
if tonumber(redis.call('GET', KEYS[2]) or '0') < token then
  redis.call('SET', KEYS[2], token)  -- the counter went with the lease: never hand this token out again
end
local expire_at = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'status', 'RUNNING', 'ownerId', ARGV[1], 'ownerToken', token,
  'leaseTtl', ARGV[3], 'taskName', ARGV[4], 'attempt', ARGV[6], 'takeovers', ARGV[7],
  'maxTakeovers', ARGV[8], 'currentStage', ARGV[9], 'progressVersion', 0, 'heartbeatAt', now,
  'lastProgressAt', now, 'leaseExpireAt', expire_at, 'restoredAt', now)
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'call', ARGV[5])
end
redis.call('ZADD', KEYS[3], expire_at, KEYS[1])
return {'restored'}
