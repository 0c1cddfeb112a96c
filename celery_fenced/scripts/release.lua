-- release.lua: the owner ends its attempt without storing a READY result.
--
-- KEYS[1]  lease hash
-- KEYS[2]  expiry index
-- ARGV[1]  ownerId
-- ARGV[2]  ownerToken
-- ARGV[3]  new status:
--            "DONE"      the task ended without a result (Ignore, ignore_result, Reject
--                        without requeue): the lease becomes a DONE tombstone (no result
--                        carries its fence) that expires after ARGV[5] ms (0: never)
--            "RETRYING"  a retry message is due; the reaper looks again after ARGV[4] ms
--            "REQUEUED"  the message went back to the broker (Reject requeue=True);
--                        the reaper re-sends it if nobody acquires it within ARGV[4] ms
--            "HANDOFF"   the task id passes to a replacement (Task.replace()): the lease
--                        is deleted, so the replacement, fenced or not, starts afresh
--                        (a fenced one takes a new, higher token)
-- ARGV[4]  ms until the reaper may act (RETRYING, REQUEUED)
-- ARGV[5]  ms the lease hash lives once DONE (the result expiry; 0 = no expiry)
-- ARGV[6..9] the owner's last progress, as renew.lua takes it: stage, progressVersion,
--          progress age ms, details (JSON, "" = unchanged); published for RETRYING and
--          REQUEUED, so a retry or a later run starts from the owner's latest checkpoint
--
-- Returns {code}: "ok" | "stale-token" | "not-owner" | "finished" | "missing"
local now = now_ms()
local refusal, status = owner_refusal(KEYS[1], ARGV[1], ARGV[2])
if refusal then
  return {refusal}
end
if status == 'DONE' or status == 'ABANDONED' then
  return {'finished'}
end
local target = ARGV[3]
if (target == 'RETRYING' or target == 'REQUEUED') and ARGV[6] then
  publish_progress(KEYS[1], nil, now, ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9])
end
if target == 'HANDOFF' then
  redis.call('ZREM', KEYS[2], KEYS[1])
  redis.call('DEL', KEYS[1])
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
  if target == 'REQUEUED' then
    redis.call('HSET', KEYS[1], 'requeuedAt', int_arg(now))
  end
end
return {'ok'}
