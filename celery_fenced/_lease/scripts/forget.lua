-- forget.lua: AsyncResult.forget(): remove a task's result, not the fact that it is done.
--
-- Celery's forget deletes the result key. A finished task's lease most often lives only in
-- that result (its fence: fence_of()), so a late copy of its message (a re-send still in a
-- queue, a copy the broker gives back after its visibility timeout) would then be a first
-- delivery and run the task again. Here the result goes, and what refusing that copy and a
-- late write needs stays: a DONE tombstone (status, final token, run, attempt, takeovers,
-- the READY state, forgottenAt) that expires after ARGV[1] ms, the time a copy can still
-- arrive. A finished lease hash (a DONE or ABANDONED tombstone) is kept for that time too.
-- A lease still in use (live, waiting, handed off) is left as it is; a result with neither
-- fence nor lease (a plain task's) is deleted, as Celery does.
--
-- KEYS[1]  lease hash
-- KEYS[2]  Celery's result key
-- ARGV[1]  ms the tombstone lives (> 0)
--
-- Returns {code}:
--   "forgotten"  the task was finished: its result deleted, its tombstone expires in ARGV[1] ms
--   "deleted"    the result deleted (if any); the lease, in use, left alone, or none
local now = now_ms_text()
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  local token, run, state = finished_fence(KEYS[2])
  redis.call('DEL', KEYS[2])
  if not token then
    return {'deleted'}
  end
  local publish, attempt, takeovers = string.match(run, '^(.*)/(%d+)/(%d+)$')
  redis.call('HSET', KEYS[1], 'status', 'DONE', 'ownerToken', token, 'attempt', attempt or '1',
    'takeovers', takeovers or '0', 'resultState', state, 'forgottenAt', now)
  if publish and publish ~= '' then
    redis.call('HSET', KEYS[1], 'publishId', publish)
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return {'forgotten'}
end
redis.call('DEL', KEYS[2])
if status ~= 'DONE' and status ~= 'ABANDONED' then
  return {'deleted'}
end
redis.call('HSET', KEYS[1], 'forgottenAt', now)
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {'forgotten'}
