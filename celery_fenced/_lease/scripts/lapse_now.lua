-- lapse_now.lua: make a live lease due for takeover now, as if its owner were gone
-- (an operator's and a test's action).
--
-- The lease is marked LAPSED with lapseReason "gone", not only given a past expiry: a
-- renewal after a real expiry is accepted (one Redis blip must not become a takeover), so an
-- owner that is in fact alive would renew a merely expired lease before the reaper's next
-- pass, and the takeover asked for would not happen. Its next renewal answers "lapsed"
-- instead, and the claim counts the takeover as cause "gone".
--
-- A worker's main process also lapses a lease whose owner process it lost, where Celery puts
-- the message back instead of writing the WorkerLostError that would lapse it (store.lua):
-- with task_acks_late and task_reject_on_worker_lost. ARGV[1] is then the owner-id prefix of
-- that process ("<hostname>/<pid>/"): a lease another process owns (a newer owner) is left
-- alone ("not-live"), and lapseReason is "worker-lost".
--
-- Where Celery 5.7 retries the lost process's task (retry_on_worker_lost), ARGV[2] is the time
-- until that retry is overdue: the retry's countdown and the requeue timeout. The lease is
-- then RETRYING, as the tokenless RETRY write Celery makes after sending the retry would make
-- it, and due only then: a LAPSED lease would be due at once, and a reaper pass between this
-- and that write would send the original call (its retries count 0) as a takeover.
--
-- KEYS[1]  lease hash
-- KEYS[2]  expiry index
-- ARGV[1]  the owner-id prefix of the lost process, or "" / absent: any owner
-- ARGV[2]  with ARGV[1]: ms until the retry Celery sends is overdue, or absent: no retry
--
-- Returns {code}: "lapsed" | "retrying" | "not-live" | "missing"
local now = now_ms()
local f = redis.call('HMGET', KEYS[1], 'status', 'ownerId')
local status = f[1]
if not status then
  return {'missing'}
end
if status ~= 'RUNNING' and status ~= 'STALLED' then
  return {'not-live'}
end
local prefix = ARGV[1] or ''
local reason = 'gone'
if prefix ~= '' then
  if string.sub(f[2] or '', 1, #prefix) ~= prefix then
    return {'not-live'}
  end
  reason = 'worker-lost'
  if ARGV[2] then
    local due = now + tonumber(ARGV[2])
    redis.call('ZADD', KEYS[2], due, KEYS[1])
    redis.call('HSET', KEYS[1], 'status', 'RETRYING', 'leaseExpireAt', due)
    return {'retrying'}
  end
end
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('HSET', KEYS[1], 'status', 'LAPSED', 'leaseExpireAt', now, 'lapsedAt', now,
  'lapseReason', reason)
return {'lapsed'}
