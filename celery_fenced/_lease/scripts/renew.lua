-- renew.lua: renew every lease one worker process holds, in one call.
--
-- KEYS[1]      expiry index <prefix>:leases
-- KEYS[2..n]   lease hashes, one per lease renewed
-- ARGV is 8 values per lease, in the order of KEYS[2..n]:
--   ownerId, ownerToken, ttl ms, stage ("" = unchanged), progressVersion,
--   progress age ms (how long ago, by the owner's monotonic clock, that version was made),
--   status to keep ("RUNNING", or "STALLED" while an alert-mode task is stalled),
--   details (JSON of the latest progress() details, "" = unchanged)
--
-- A renewal is accepted when owner, token and status (RUNNING or STALLED) match, even if
-- the expiry has just passed, as long as no claim took the lease: one Redis blip must not
-- become mass takeovers. progressVersion never moves back; lastProgressAt is server TIME
-- minus the reported age, so the owner's wall clock never matters. Only an accepted renewal
-- writes stage and details: a stale token never does.
--
-- A DONE lease answers "finished" to its last owner, "cancelled" after a cancel (which ends
-- a lease with a fresh token), "stale-token" to an owner whose task was taken over and
-- finished by the new one; an ABANDONED lease answers "claimed" whatever the token. A
-- HANDED_OFF record answers "finished" to the owner that handed it off, "stale-token" to
-- any other. A live lease of an older token, or a reservation (no token), answers "missing"
-- to a newer token: tokens are handed out in order, so such a lease was written after the
-- store lost the newer owner's (data loss), which the owner then writes back (restore.lua).
-- So does the owner's own lease once it has run out on another server than the one it was
-- acquired or written back on (came_back(): a failover, or a restart that kept the data, may
-- have lost a claim of it and a newer owner's acquire): the renewal past the expiry is
-- accepted only where no claim can have been lost.
--
-- Returns one code per lease: "ok" | "stale-token" | "not-owner" | "claimed" (REQUEUED or
--   ABANDONED) | "lapsed" (given up) | "finished" (DONE, HANDED_OFF) | "cancelled" (DONE by a cancel) |
--   "retrying" | "missing"
local now = now_ms()
local now_arg = int_arg(now)
local codes = {}
for i = 2, #KEYS do
  local base = (i - 2) * 8
  local owner, token, ttl = ARGV[base + 1], ARGV[base + 2], tonumber(ARGV[base + 3])
  local stage, version, age = ARGV[base + 4], tonumber(ARGV[base + 5]), tonumber(ARGV[base + 6])
  local keep, details = ARGV[base + 7], ARGV[base + 8]
  local lease = KEYS[i]
  local cur = redis.call('HMGET', lease, 'status', 'ownerToken', 'ownerId', 'progressVersion', 'cancelledAt',
    'leaseExpireAt', 'primary')
  local status = cur[1]
  local code
  if not status then
    code = 'missing'
  elseif status == 'DONE' and cur[2] ~= token and not cur[5] then
    code = 'stale-token'  -- taken over, and the new owner has finished it since
  elseif status == 'DONE' and cur[5] then
    code = 'cancelled'
  elseif status == 'DONE' then
    code = 'finished'
  elseif status == 'ABANDONED' then
    code = 'claimed'
  elseif status == 'HANDED_OFF' and cur[2] == token then
    code = 'finished'  -- its owner handed it to a replacement
  elseif cur[2] ~= token and (status == 'HANDED_OFF' or tonumber(cur[2] or '0') > tonumber(token)) then
    code = 'stale-token'
  elseif cur[2] ~= token then
    -- An older token's lease (or a reservation, no token) where this owner's newer one was:
    -- written after the store lost this owner's lease (an older owner's write-back, a copy of
    -- the message received). As if missing: the owner writes its own back (restore.lua).
    code = 'missing'
  elseif cur[3] ~= owner then
    code = 'not-owner'
  elseif (status == 'RUNNING' or status == 'STALLED') and came_back(cur[6], cur[7], now) then
    code = 'missing'
  elseif status == 'RUNNING' or status == 'STALLED' then
    code = 'ok'
    local expire_arg = int_arg(now + ttl)
    redis.call('ZADD', KEYS[1], expire_arg, lease)
    redis.call('HSET', lease, 'heartbeatAt', now_arg, 'leaseExpireAt', expire_arg, 'status', keep)
    if keep == 'RUNNING' then
      redis.call('HDEL', lease, 'stalledAt')
    elseif not redis.call('HGET', lease, 'stalledAt') then
      redis.call('HSET', lease, 'stalledAt', now_arg)
    end
    publish_progress(lease, cur[4] or '0', now, stage, version, age, details)
  elseif status == 'REQUEUED' then
    code = 'claimed'
  elseif status == 'LAPSED' then
    code = 'lapsed'
  else
    code = 'retrying'
  end
  codes[#codes + 1] = code
end
return codes
