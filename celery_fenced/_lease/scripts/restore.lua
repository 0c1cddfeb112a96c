-- restore.lua: a live owner puts back its lease after the hash vanished from Redis.
--
-- An evicted key, a FLUSH, or a failover that lost writes can delete a lease while its owner
-- runs. The owner then writes it again, with the call it recorded, so the task is neither
-- lost (the reaper can still re-send it) nor stopped: it finishes under its own token.
--
-- Only an owner whose lease cannot have expired gets it back as RUNNING: its last accepted
-- renewal (ARGV[10], measured by the owner's monotonic clock from when it sent that
-- renewal, which is before the server extended the lease) is less than a TTL ago. Past
-- that, another owner may have been given the task, and its lease may have vanished too:
-- "expired", nothing written. An owner that gave its lease up on its own clock writes it
-- back LAPSED instead (ARGV[11] "lapsed"), so the reaper re-sends the task: it is due a TTL
-- from now, not at once, because a newer owner whose lease vanished with it may still be live
-- (the store lost data), and writes its own back within that TTL.
--
-- Between two owners the newer token wins: an owner whose lease is there with an older token,
-- or as a reservation (no token), puts its own in its place, under the same rule (RUNNING:
-- its last renewal less than a TTL ago). Tokens are handed out in order, so such a lease was
-- written after the store lost this owner's. A lapsed write-back never replaces a lease.
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
-- ARGV[10] ms since the owner sent its last accepted renewal (or acquired), by its own clock
-- ARGV[11] "lapsed": write it back given up (LAPSED, due now); "" or absent: RUNNING
-- ARGV[12] the run's publishId, "" or absent: none
-- ARGV[13] the run's handoffToken (the hand-off that started it: a replacement's run), "" or
--          absent: none; written back so a copy of the message it replaced still does not run
--
-- Returns {code}:
--   "restored"  the lease is back, RUNNING for this owner, due at now + ttl (or LAPSED,
--               due now)
--   "expired"   the owner's lease could have expired (ARGV[10] >= ttl): nothing written
--   "exists"    a lease exists (another delivery acquired it meanwhile, with a newer
--               token, or it is finished or handed off): nothing written
--   "finished"  the task finished under this token: its lease lives on in the result
--               (fence_of()), nothing written
--   "stale-token"  the task finished under another token: nothing written
--
-- An owner whose own lease is there, RUNNING with its token (it asks again: its reply was
-- lost to a connection error, and the client sent it again), is answered "restored", nothing
-- written, not "exists" (which would make it give up a lease it holds). Unless that lease ran
-- out on another server than the one it was acquired or written back on (came_back(): a
-- failover or a restart that kept the data, which may have lost a claim of it and a newer
-- owner's acquire): then it is written again under the rule above, as a vanished one, and a
-- thawed owner gets "expired".
local lapsed = ARGV[11] == 'lapsed'
local replaced = false
local mine = false
if redis.call('EXISTS', KEYS[1]) == 1 then
  local cur = redis.call('HMGET', KEYS[1], 'ownerId', 'ownerToken', 'status', 'leaseExpireAt', 'primary')
  mine = cur[1] == ARGV[1] and cur[2] == ARGV[2] and (cur[3] == 'RUNNING' or cur[3] == 'STALLED')
  if mine and not came_back(cur[4], cur[5]) then
    return {'restored'}
  end
  -- Its own lease run out and come back with a failover (came_back()) is written again under
  -- the rule below, as a vanished one: a claim of it and a newer owner's may have been lost.
  if lapsed or (not mine and (cur[3] == 'DONE' or cur[3] == 'ABANDONED' or cur[3] == 'HANDED_OFF'
      or tonumber(cur[2] or '0') >= tonumber(ARGV[2]))) then
    return {'exists'}
  end
  -- An older token's lease, or a reservation (no token): written after the store lost this
  -- owner's (an older owner's write-back, a copy of the message received). The newer token
  -- wins, under the rule below; the lease is written anew.
  replaced = true
end
local fence = finished_fence(KEYS[4])
if fence then
  if fence == ARGV[2] then
    return {'finished'}
  end
  return {'stale-token'}
end
if not lapsed and tonumber(ARGV[10]) >= tonumber(ARGV[3]) then
  return {'expired'}
end
if replaced and not mine then
  redis.call('DEL', KEYS[1])
end
local now = now_ms()
local token = tonumber(ARGV[2])
local counter = redis.call('GET', KEYS[2])
if not counter then
  -- The counter went with the lease (or alone: evicted, deleted): it starts again from the
  -- clock, as a token taken from a missing counter starts it, never from this token:
  -- tokens handed out since this one (a cancel's, a claim's) are above it, and below the
  -- clock.
  redis.call('SET', KEYS[2], int_arg(math.max(token, tonumber(now_us_text()))))
elseif tonumber(counter) < token then
  redis.call('SET', KEYS[2], int_arg(token))  -- never hand this token out again
end
local expire_at = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'status', 'RUNNING', 'ownerId', ARGV[1], 'ownerToken', token,
  'leaseTtl', ARGV[3], 'taskName', ARGV[4], 'attempt', ARGV[6], 'takeovers', ARGV[7],
  'maxTakeovers', ARGV[8], 'currentStage', ARGV[9], 'progressVersion', 0, 'heartbeatAt', now,
  'lastProgressAt', now, 'leaseExpireAt', expire_at, 'restoredAt', now, 'primary', (this_primary()))
if ARGV[5] ~= '' then
  redis.call('HSET', KEYS[1], 'call', ARGV[5])
end
if (ARGV[12] or '') ~= '' then
  redis.call('HSET', KEYS[1], 'publishId', ARGV[12])
end
if (ARGV[13] or '') ~= '' then
  redis.call('HSET', KEYS[1], 'handoffToken', ARGV[13])
end
if lapsed then
  -- Due a TTL from now, not at once: a newer owner whose lease vanished with this one's (the
  -- store lost data) is still live if it renewed within the TTL, and writes its own back over
  -- this one first (the newer token wins). Only then may the reaper re-send the task.
  redis.call('HSET', KEYS[1], 'status', 'LAPSED', 'lapsedAt', now, 'lapseReason', 'data-lost')
end
redis.call('ZADD', KEYS[3], expire_at, KEYS[1])
return {'restored'}
