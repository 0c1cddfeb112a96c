-- replacement_sent.lua: the owner that handed off (release.lua, HANDOFF) sent its
-- replacement: its HANDED_OFF record waits for the replacement to start, whatever becomes of
-- the owner.
--
-- KEYS[1]  lease hash
-- KEYS[2]  optional: the reservations of the owner's worker, where the hand-off filed it
-- ARGV[1]  ownerId
-- ARGV[2]  ownerToken: the token that handed off (the record's handoffToken)
--
-- Until this is said, an owner lost (its process: store.lua; its whole worker:
-- lapse_worker.lua) makes the record due, and the reaper undoes the hand-off and takes the task
-- over (claim.lua), as the replacement may never have been sent. Once said, the record waits
-- for the replacement, sent and on its way. Only this owner's own record, as the hand-off left
-- it: once the replacement started, or the reaper undid the hand-off, nothing is written.
-- Said again (a lost reply): "ok" again.
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
if KEYS[2] then
  redis.call('ZREM', KEYS[2], KEYS[1])
end
return {'ok'}
