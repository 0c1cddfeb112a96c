-- claim.lua: the reaper claims one lease that is due, atomically.
--
-- The expiry index is only a hint: this script re-validates the lease itself, so a stale
-- or missing-lease index entry is harmless and several reapers may run at once (only one
-- of them gets "requeued" for a given expiry).
--
-- KEYS[1]  lease hash
-- KEYS[2]  Celery's result key
-- KEYS[3]  expiry index
-- KEYS[4]  dead letters: sorted set of abandoned lease keys by the time they were abandoned
-- ARGV[1]  takeover grace, ms (added to the expiry of RUNNING, STALLED and LAPSED leases)
-- ARGV[2]  requeue timeout, ms (a REQUEUED task not acquired by then is due again)
-- ARGV[3]  a fresh token reserved for this claim, used only if the task is abandoned
-- ARGV[4]  encoded FAILURE meta (TaskAbandonedError) carrying that token as fence_token
-- ARGV[5]  result expiry, ms (0: none)
--
-- Returns {code, cause, lease fields as a flat list}:
--   "requeued"   claimed: the caller re-sends the original call (cause: "stalled", "gone",
--                "redrive" for an abandoned task put back by an operator: these count as
--                takeovers; "resend" for a re-send after the requeue timeout, "retry" for
--                a retry message not started and "unstarted" for a message a worker received
--                and did not start within the start timeout: these never count, and never
--                abandon), or, with cause "handoff", the recorded replacement (handoffCall) of
--                a hand-off said sent whose replacement did not start within the requeue
--                timeout (never counts, never abandons; the record stays HANDED_OFF)
--   "abandoned"  takeovers exhausted: FAILURE stored, lease ABANDONED
--   "not-due"    live or not yet due: the index entry was moved to the real due time
--   "waiting"    a re-sent (or retry) message still waits in the queue and was sent as often
--                as allowed: nothing sent, looked at again after the requeue timeout
--   "finished"   DONE or ABANDONED already, or HANDED_OFF (the replacement's message is on
--                its way; once received, its reservation stands for it; one said sent with
--                its replacement recorded is due instead, see "requeued"): the index entry
--                was removed. A HANDED_OFF record whose owner was lost before it said it
--                sent the replacement (replacement_sent.lua) is due instead (lapseReason
--                "worker-lost": its process, store.lua; its whole worker, lapse_worker.lua):
--                once due, its hand-off is undone and the task taken over (cause "gone")
--   "missing"    no lease: the index entry was removed
--   "retry-later" the reserved token is not newer than the lease's: try on the next pass
--
-- A claim asked again (its reply was lost to a connection error, and the client sent it
-- again: redis-py retries by default) gets the same answer: the claim records its reserved
-- token (claimToken), which no other claim has. Otherwise the repeat would answer "not-due"
-- or "finished", and the caller would neither re-send the task nor run an abandoned task's
-- side effects (its chord part, the rest of its chain, its errbacks).
local now = now_ms()
local first = redis.call('HMGET', KEYS[1], 'status', 'claimToken')
local status = first[1]
if not status then
  redis.call('ZREM', KEYS[3], KEYS[1])
  return {'missing', '', {}}
end
if first[2] == ARGV[3] then
  if status == 'ABANDONED' then
    return {'abandoned', redis.call('HGET', KEYS[1], 'abandonCause') or '', redis.call('HGETALL', KEYS[1])}
  elseif status == 'REQUEUED' or status == 'HANDED_OFF' then
    return {'requeued', redis.call('HGET', KEYS[1], 'claimCause') or '', redis.call('HGETALL', KEYS[1])}
  end
end
local recorded = status == 'HANDED_OFF' and redis.call('HMGET', KEYS[1], 'handoffCall', 'handoffSent', 'lapseReason')
if recorded and recorded[1] and (recorded[2] == '1' or recorded[3] == 'worker-lost') then
  -- The replacement is recorded (release.lua), and its owner said it sent it (due a requeue
  -- timeout later: replacement_sent.lua) or was lost before it said so (due once its process
  -- or its whole worker was lost: store.lua, lapse_worker.lua), and it has not started since:
  -- its message was lost (a broker that lost data), waits behind others, or was never sent.
  -- Once due, it is sent again, the same message under the same ids (a copy of one sent
  -- after all does not run twice), as a re-sent task is: at most max(maxTakeovers, 1)
  -- times, then looked at again after each requeue timeout. The hand-off is never undone
  -- here: the replaced body does not run again, and only the replacement starts the task id.
  local r = redis.call('HMGET', KEYS[1], 'leaseExpireAt', 'resends', 'maxTakeovers')
  if tonumber(r[1] or '0') > now then
    redis.call('ZADD', KEYS[3], r[1], KEYS[1])
    return {'not-due', status, {}}
  end
  local resends = tonumber(r[2] or '0')
  local next_due = int_arg(now + tonumber(ARGV[2]))
  redis.call('ZADD', KEYS[3], next_due, KEYS[1])
  redis.call('HSET', KEYS[1], 'leaseExpireAt', next_due)
  if resends >= math.max(tonumber(r[3] or '0'), 1) then
    return {'waiting', 'handoff', {}}
  end
  redis.call('HSET', KEYS[1], 'resends', resends + 1, 'requeuedAt', now, 'claimCause', 'handoff',
    'claimToken', ARGV[3])
  return {'requeued', 'handoff', redis.call('HGETALL', KEYS[1])}
end
if status == 'HANDED_OFF' then
  local h = redis.call('HMGET', KEYS[1], 'lapseReason', 'leaseExpireAt', 'handoffPrior', 'handoffSent')
  if h[1] ~= 'worker-lost' or h[4] == '1' then
    redis.call('ZREM', KEYS[3], KEYS[1])
    return {'finished', status, {}}
  end
  -- The owner was lost before it said it sent the replacement, and the replacement has not
  -- started: it may never have been sent. Once due, the hand-off is undone (undo_hand_off: the
  -- run's own hand-off token back, the record's expiry gone) and the task is taken over below,
  -- as a lease whose owner was lost.
  if tonumber(h[2] or '0') > now then
    redis.call('ZADD', KEYS[3], h[2], KEYS[1])
    return {'not-due', status, {}}
  end
  undo_hand_off(KEYS[1], h[3])
  redis.call('HSET', KEYS[1], 'status', 'LAPSED')
  status = 'LAPSED'
end
if status == 'DONE' or status == 'ABANDONED' then
  redis.call('ZREM', KEYS[3], KEYS[1])
  return {'finished', status, {}}
end
local f = redis.call('HMGET', KEYS[1], 'leaseExpireAt', 'ownerToken', 'takeovers',
  'maxTakeovers', 'stalledAt', 'lapseReason')
local due = tonumber(f[1] or '0')
if status == 'RUNNING' or status == 'STALLED' or status == 'LAPSED' then
  due = due + tonumber(ARGV[1])
end
if due > now then
  redis.call('ZADD', KEYS[3], due, KEYS[1])
  return {'not-due', status, {}}
end

local cause
if status == 'LAPSED' then
  if f[6] == 'worker-lost' or f[6] == 'gone' or f[6] == 'unfinished' or f[6] == 'data-lost' then
    cause = 'gone'
  elseif f[6] == 'redrive' then
    cause = 'redrive'
  else
    cause = 'stalled'
  end
elseif status == 'REQUEUED' then
  cause = 'resend'
elseif status == 'RETRYING' then
  cause = 'retry'
elseif status == 'RESERVED' then
  cause = 'unstarted'
elseif f[5] and status == 'RUNNING' then
  cause = 'stalled'
else
  cause = 'gone'
end

local max_takeovers = tonumber(f[4] or '0')
local takeovers = tonumber(f[3] or '0')
if cause == 'unstarted' then
  -- The receiving worker dropped the message (connection lost, worker killed) or holds it
  -- behind a stuck process: one message more, once per start timeout, never a takeover.
  local next_due = now + tonumber(ARGV[2])
  redis.call('ZADD', KEYS[3], next_due, KEYS[1])
  redis.call('HSET', KEYS[1], 'status', 'REQUEUED', 'requeuedAt', now, 'leaseExpireAt', next_due,
    'claimCause', cause, 'claimToken', ARGV[3])
  return {'requeued', cause, redis.call('HGETALL', KEYS[1])}
end
if cause == 'resend' or cause == 'retry' then
  -- Nobody acquired a message that is already in the queue: a backlog, not a failure. It
  -- is sent again at most max(maxTakeovers, 1) times in all, never counted as a takeover
  -- and never abandoned; past that it only waits (looked at again after the timeout).
  local resends = tonumber(redis.call('HGET', KEYS[1], 'resends') or '0')
  local next_due = now + tonumber(ARGV[2])
  redis.call('ZADD', KEYS[3], next_due, KEYS[1])
  redis.call('HSET', KEYS[1], 'leaseExpireAt', next_due)
  if resends >= math.max(max_takeovers, 1) then
    return {'waiting', cause, {}}
  end
  redis.call('HSET', KEYS[1], 'status', 'REQUEUED', 'resends', resends + 1, 'requeuedAt', now,
    'claimCause', cause, 'claimToken', ARGV[3])
  return {'requeued', cause, redis.call('HGETALL', KEYS[1])}
end
takeovers = takeovers + 1
if takeovers > max_takeovers then
  local token = tonumber(ARGV[3])
  if token <= tonumber(f[2] or '0') then
    return {'retry-later', cause, {}}
  end
  local meta = ARGV[4]
  local expires = tonumber(ARGV[5])
  write_result(KEYS[2], meta, expires)
  if expires > 0 then
    redis.call('PEXPIRE', KEYS[1], expires)
  end
  redis.call('ZREM', KEYS[3], KEYS[1])
  redis.call('ZADD', KEYS[4], now, KEYS[1])
  redis.call('HSET', KEYS[1], 'status', 'ABANDONED', 'ownerToken', token, 'ownerId', '',
    'leaseExpireAt', now, 'finishedAt', now, 'abandonCause', cause, 'claimToken', ARGV[3])
  return {'abandoned', cause, redis.call('HGETALL', KEYS[1])}
end

local next_due = now + tonumber(ARGV[2])
redis.call('ZADD', KEYS[3], next_due, KEYS[1])
redis.call('HSET', KEYS[1], 'status', 'REQUEUED', 'takeovers', takeovers, 'requeuedAt', now,
  'leaseExpireAt', next_due, 'claimCause', cause, 'claimToken', ARGV[3])
return {'requeued', cause, redis.call('HGETALL', KEYS[1])}
