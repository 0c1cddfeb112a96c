-- replacement_sent.lua: the owner that handed off (release.lua, HANDOFF) sent its
-- replacement: its HANDED_OFF record waits for the replacement to start, and is no longer due.
--
-- KEYS[1]  lease hash
-- KEYS[2]  expiry index
-- ARGV[1]  ownerId
-- ARGV[2]  ownerToken: the token that handed off (the record's handoffToken)
--
-- Until this is said, the record is due at the end of the send's window: an owner lost
-- between its hand-off and its send (a whole worker killed) sent nothing, and the reaper
-- undoes the hand-off once due and takes the task over (claim.lua). Only this owner's own
-- record, as the hand-off left it: once the replacement started (reserve.lua, acquire.lua), or
-- the reaper undid the hand-off, nothing is written. Said again (a lost reply): "ok" again.
--
-- Returns {code}: "ok" | "stale-token" | "not-owner" | "missing" | "finished" (no hand-off of
-- this token waits for its replacement)
local refusal, status = owner_refusal(KEYS[1], ARGV[1], ARGV[2])
if refusal then
  return {refusal}
end
if status ~= 'HANDED_OFF' or redis.call('HGET', KEYS[1], 'handoffToken') ~= ARGV[2] then
  return {'finished'}
end
redis.call('HSET', KEYS[1], 'handoffSent', 1)
redis.call('HDEL', KEYS[1], 'leaseExpireAt')
redis.call('ZREM', KEYS[2], KEYS[1])
return {'ok'}
