-- cancel.lua: end a task for good with a fenced REVOKED result.
--
-- The cancel takes a fresh token, so every owner's later write is stale and its next
-- progress() (or renewal) learns that the lease is gone. A task not started yet gets a
-- DONE lease, so no later delivery runs it.
--
-- KEYS[1]  lease hash
-- KEYS[2]  Celery's result key
-- KEYS[3]  expiry index
-- ARGV[1]  a fresh token reserved for the cancel
-- ARGV[2]  encoded REVOKED meta carrying that token as fence_token
-- ARGV[3]  result expiry, ms (0: none)
-- ARGV[4]  "1": cancel a task id with neither lease nor result (one still waiting in the
--          queue has neither); "0": such an id is unknown, and nothing is stored
--
-- Returns {code, previous status}: "cancelled" | "finished" (already DONE or ABANDONED, or
--   a result stored and its lease gone) | "unknown" (no lease, no result, ARGV[4] "0") |
--   "retry-later" (the reserved token is not newer than the lease's)
--
-- The cancel's token becomes ownerToken (it fences every later write); the token the owner
-- held (the current or last one) is kept as cancelledOwnerToken, so inspect shows both.
--
-- A cancel asked again (its reply was lost to a connection error, and the client sent it
-- again) gets the same answer: its token is the cancel's own, and the status it found is
-- kept (cancelledFrom). Otherwise the repeat would answer "finished", and the caller would
-- not run the cancel's side effects (a chord member's part).
local now = now_ms()
local cur = redis.call('HMGET', KEYS[1], 'status', 'ownerToken', 'cancelledAt', 'cancelledFrom')
local status = cur[1] or ''
if status == 'DONE' and cur[2] == ARGV[1] and cur[3] then
  return {'cancelled', cur[4] or ''}
end
if status == 'DONE' or status == 'ABANDONED' then
  return {'finished', status}
end
if status == '' then
  if redis.call('EXISTS', KEYS[2]) == 1 then
    return {'finished', 'result'}
  end
  if ARGV[4] ~= '1' then
    return {'unknown', ''}
  end
end
if tonumber(ARGV[1]) <= tonumber(cur[2] or '0') then
  return {'retry-later', status}
end
local expires = tonumber(ARGV[3])
write_result(KEYS[2], ARGV[2], expires)
redis.call('ZREM', KEYS[3], KEYS[1])
redis.call('HSET', KEYS[1], 'status', 'DONE', 'ownerToken', ARGV[1], 'leaseExpireAt', now,
  'finishedAt', now, 'resultState', 'REVOKED', 'cancelledAt', now, 'cancelledFrom', status)
-- The owner's token, for inspect: ownerToken is the cancel's from now on.
if cur[2] then
  redis.call('HSET', KEYS[1], 'cancelledOwnerToken', cur[2])
end
if expires > 0 then
  redis.call('PEXPIRE', KEYS[1], expires)
end
return {'cancelled', status}
