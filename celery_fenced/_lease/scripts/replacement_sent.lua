-- replacement_sent.lua: the owner that handed off (release.lua, HANDOFF) sent its
-- replacement: its HANDED_OFF record waits for the replacement to start, whatever becomes of
-- the owner.
--
-- KEYS[1]  lease hash
-- KEYS[2]  expiry index
-- KEYS[3]  optional: the reservations of the owner's worker, where the hand-off filed it
-- ARGV[1]  ownerId
-- ARGV[2]  ownerToken: the token that handed off (the record's handoffToken)
-- ARGV[3]  with KEYS[3]: the worker's id (the record's handoffWorker); else ""
-- ARGV[4]  ms until the reaper looks whether the replacement started (the requeue timeout),
--          for a record that keeps its replacement (handoffCall, release.lua); absent: never
--
-- Until this is said, an owner lost (its process: store.lua; its whole worker:
-- lapse_worker.lua) makes the record due, and the reaper undoes the hand-off and takes the task
-- over (claim.lua), as the replacement may never have been sent. Once said, the record waits
-- for the replacement, sent and on its way. Only this owner's own record, as the hand-off left
-- it: once the replacement started, or the reaper undid the hand-off, nothing is written.
-- Said again (a lost reply): "ok" again. Whatever the answer, the filing leaves the worker's
-- set (its owner is done with it), unless the record is a newer hand-off of the same worker,
-- not said sent (a replacement's run on this worker that handed off in turn).
--
-- With the replacement recorded (handoffCall), the record is due ARGV[4] ms from now: a
-- replacement that has not started by then (the broker lost its message: a broker Redis
-- restarted without data) is sent again by the reaper (claim.lua), the same message under the
-- same ids, so a copy of one that was only late is a copy: it does not run twice.
--
-- Returns {code}: "ok" | "stale-token" | "not-owner" | "missing" | "finished" (no hand-off of
-- this token waits for its replacement)
local r = redis.call('HMGET', KEYS[1], 'status', 'handoffToken', 'handoffWorker', 'handoffSent', 'reservedBy')
local refusal, status = owner_refusal(KEYS[1], ARGV[1], ARGV[2])
if refusal == 'not-owner' and r[1] == 'RESERVED' and r[2] == ARGV[2] then
  refusal = nil  -- the replacement's reservation took the record's place (reserve.lua): finished
end
local mine = not refusal and status == 'HANDED_OFF' and r[2] == ARGV[2]
-- A reservation this worker holds (a copy it received since) is filed under the same member:
-- it stays, for the worker's lapse to make it due (lapse_worker.lua).
local host = r[5]
local reserved_here = r[1] == 'RESERVED' and host and string.sub(ARGV[3] or '', 1, #host + 1) == host .. '/'
if KEYS[3] and not reserved_here and (mine or not (r[1] == 'HANDED_OFF' and r[3] == ARGV[3] and r[4] ~= '1')) then
  redis.call('ZREM', KEYS[3], KEYS[1])
end
if refusal then
  return {refusal}
end
if not mine then
  return {'finished'}
end
redis.call('HSET', KEYS[1], 'handoffSent', 1)
if ARGV[4] and r[4] ~= '1' and redis.call('HEXISTS', KEYS[1], 'handoffCall') == 1 then
  local due = int_arg(now_ms() + tonumber(ARGV[4]))
  redis.call('HSET', KEYS[1], 'leaseExpireAt', due)
  redis.call('ZADD', KEYS[2], due, KEYS[1])
end
return {'ok'}
