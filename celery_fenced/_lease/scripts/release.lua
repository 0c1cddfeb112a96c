-- release.lua: the owner ends its attempt without storing a READY result.
--
-- KEYS[1]  lease hash
-- KEYS[2]  expiry index
-- KEYS[3]  HANDOFF, optional: the reservations of the owner's worker (one start of it)
-- ARGV[1]  ownerId
-- ARGV[2]  ownerToken
-- ARGV[3]  new status:
--            "DONE"      the task ended without a result (Ignore, ignore_result, Reject
--                        without requeue): the lease becomes a DONE tombstone (no result
--                        carries its fence) that expires after ARGV[5] ms (0: never)
--            "RETRYING"  a retry message is due; the reaper looks again after ARGV[4] ms
--            "REQUEUED"  the message went back to the broker (Reject requeue=True);
--                        the reaper re-sends it if nobody acquires it within ARGV[4] ms
--            "HANDOFF"   the task id passes to a replacement (Task.replace()), fenced like a
--                        write: only the current owner hands off (a newer token, a missing
--                        lease, a finished task: refused, and nothing may be sent). The lease
--                        becomes a HANDED_OFF record (who handed off, with which token, which
--                        run) that expires after ARGV[5] ms (0: never). Its handoffToken is the
--                        owner's token: the replacement's message names it (acquire.lua), a
--                        later copy of the original message does not, and an older token's
--                        call is refused like any stale owner's. The record keeps the
--                        recorded call, the takeover limit and the run's own hand-off token
--                        (handoffPrior), for a hand-back (hand_back.lua) when the replacement
--                        cannot be sent. With KEYS[3], the record is filed among the owner's
--                        worker's reservations until the owner says it sent the replacement
--                        (replacement_sent.lua): a whole worker lost between its hand-off and
--                        the send sent nothing and says nothing, and once its liveness record
--                        lapses (lapse_worker.lua) the reaper undoes the hand-off and takes the
--                        task over (claim.lua). A live owner, however slow its send, is left
--                        alone: only it may send the replacement
-- ARGV[4]  RETRYING, REQUEUED: ms until the reaper may act; HANDOFF: the id of the owner's
--          worker (with KEYS[3])
-- ARGV[5]  ms the lease hash lives once DONE or HANDED_OFF (the result expiry; 0 = no expiry)
-- ARGV[6..9] the owner's last progress, as renew.lua takes it: stage, progressVersion,
--          progress age ms, details (JSON, "" = unchanged); published for RETRYING and
--          REQUEUED, so a retry or a later run starts from the owner's latest checkpoint
-- ARGV[10] RETRYING: the retry's own call (JSON: its arguments and retries), recorded in
--          place of the retried run's, so the reaper's re-send of an overdue retry sends the
--          retry and not the run that retried; "" or absent: the recorded call is kept.
--          HANDOFF: the replacement, as it is about to be sent (JSON of its signature, every
--          id in it frozen), kept as handoffCall: should its owner be lost before it says it
--          sent it, or should it not start within the requeue timeout once said sent, the
--          reaper sends it again (claim.lua) instead of running the replaced body again;
--          "" or absent: not recorded (ARGV[6..9] are then "")
--
-- A hand-off asked again by the owner that made it (its reply was lost) answers "ok" again.
--
-- Returns {code}: "ok" | "stale-token" | "not-owner" | "finished" | "missing"
local now = now_ms()
local refusal, status = owner_refusal(KEYS[1], ARGV[1], ARGV[2])
if refusal then
  return {refusal}
end
local target = ARGV[3]
if status == 'HANDED_OFF' then
  if target == 'HANDOFF' then
    return {'ok'}
  end
  return {'finished'}
end
if status == 'DONE' or status == 'ABANDONED' then
  return {'finished'}
end
if (target == 'RETRYING' or target == 'REQUEUED') and ARGV[6] then
  publish_progress(KEYS[1], nil, now, ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9])
end
if target == 'HANDOFF' then
  -- Kept for a hand-back (hand_back.lua: the replacement could not be sent), what the reaper
  -- needs of a running lease: the recorded call, its takeover limit, and the hand-off token
  -- this run had (a replacement's run), as handoffPrior.
  local kept = redis.call('HMGET', KEYS[1], 'call', 'maxTakeovers', 'handoffToken')
  local record = {'status', 'HANDED_OFF', 'handoffToken', ARGV[2], 'handedOffAt', int_arg(now)}
  for i, name in ipairs({'call', 'maxTakeovers', 'handoffPrior'}) do
    if kept[i] then
      record[#record + 1] = name
      record[#record + 1] = kept[i]
    end
  end
  redis.call('ZREM', KEYS[2], KEYS[1])
  if KEYS[3] then
    record[#record + 1] = 'handoffWorker'
    record[#record + 1] = ARGV[4]
  end
  if (ARGV[10] or '') ~= '' then
    record[#record + 1] = 'handoffCall'
    record[#record + 1] = ARGV[10]
  end
  end_as_tombstone(KEYS[1], record)
  local keep = tonumber(ARGV[5])
  if keep > 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[5])
  end
  if KEYS[3] then
    -- Filed as long as the record lives: once the worker lapses, lapse_worker.lua reads it there.
    local until_ms = '+inf'
    if keep > 0 then
      until_ms = int_arg(now + keep)
    end
    redis.call('ZADD', KEYS[3], until_ms, KEYS[1])
  end
elseif target == 'DONE' then
  redis.call('ZREM', KEYS[2], KEYS[1])
  end_as_tombstone(KEYS[1], {'finishedAt', int_arg(now)})
  if tonumber(ARGV[5]) > 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[5])
  end
else
  local due = int_arg(now + tonumber(ARGV[4]))
  redis.call('ZADD', KEYS[2], due, KEYS[1])
  redis.call('HSET', KEYS[1], 'status', target, 'leaseExpireAt', due)
  if target == 'RETRYING' and (ARGV[10] or '') ~= '' then
    redis.call('HSET', KEYS[1], 'call', ARGV[10])
  end
  if target == 'REQUEUED' then
    redis.call('HSET', KEYS[1], 'requeuedAt', int_arg(now))
  end
end
return {'ok'}
