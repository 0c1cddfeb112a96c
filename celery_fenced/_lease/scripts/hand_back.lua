-- hand_back.lua: the owner that handed off takes its lease back: the replacement could not be
-- sent (the send in Task.replace() raised), so no replacement will start the task id.
--
-- KEYS[1]  lease hash
-- KEYS[2]  expiry index
-- KEYS[3]  optional: the reservations of the owner's worker, where the hand-off filed it
-- ARGV[1]  ownerId
-- ARGV[2]  ownerToken: the token that handed off (the record's handoffToken)
-- ARGV[3]  lease TTL, ms
--
-- Only this owner's own HANDED_OFF record, as the hand-off left it: once the replacement
-- started (a newer token), or anything else ended the record, nothing is taken back. The lease
-- is then RUNNING again, this owner's, for a TTL, with the hand-off token it had before its
-- hand-off (a replacement's run keeps the token of the hand-off that started it), so the owner
-- stores its error through the fence as it would have without a hand-off. An owner lost before
-- it stores is taken over as any other: the record kept the recorded call (release.lua).
--
-- Returns {code}: "ok" | "stale-token" | "not-owner" | "missing" | "finished" (no hand-off of
-- this token to take back)
local refusal, status = owner_refusal(KEYS[1], ARGV[1], ARGV[2])
if refusal then
  return {refusal}
end
local record = redis.call('HMGET', KEYS[1], 'handoffToken', 'handoffPrior')
if status ~= 'HANDED_OFF' or record[1] ~= ARGV[2] then
  return {'finished'}
end
local now = now_ms()
local now_arg = int_arg(now)
local expire_arg = int_arg(now + tonumber(ARGV[3]))
undo_hand_off(KEYS[1], record[2])
if KEYS[3] then
  redis.call('ZREM', KEYS[3], KEYS[1])
end
redis.call('HSET', KEYS[1], 'status', 'RUNNING', 'leaseExpireAt', expire_arg, 'leaseTtl', ARGV[3],
  'heartbeatAt', now_arg, 'lastProgressAt', now_arg)
redis.call('ZADD', KEYS[2], expire_arg, KEYS[1])
return {'ok'}
