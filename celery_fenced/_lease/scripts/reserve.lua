-- reserve.lua: a worker received messages of fenced tasks: record each reservation where no
-- live lease exists, so a message dropped before it starts is sent again.
--
-- Celery drops a worker's prefetched and eta requests when its broker connection is lost,
-- and a killed worker takes them with it; kombu's Redis transport then holds the messages
-- for an hour. A reservation that expires before the task starts is claimed by the reaper
-- (cause "unstarted") and its recorded call sent again.
--
-- KEYS[1]    expiry index
-- KEYS[2]    the worker's reservations: sorted set of lease key -> reservation due (ms), for
--            lapse_worker.lua; an entry leaves it when its request ends on the worker
--            (unreserve.lua, lapse_reserved.lua), or here once it is due (the index has it)
-- KEYS[3..]  two per message: its lease hash, then Celery's result key
-- ARGV[1]    reservedBy: the receiving worker's hostname
-- then six values per message, in the order of its keys:
--            ms until the reservation expires (the eta's delay + the start timeout),
--            taskName, the recorded call (JSON, may be ""), maxTakeovers, publishId (may be ""),
--            the token the message says the task id was handed off from (may be "")
--
-- A lease that is missing, RESERVED (a copy received again) or REQUEUED (a re-sent message
-- received) becomes RESERVED; every other one is left alone: a live owner, a finished
-- task (its lease may live on in its result only: fence_of()), a retry or a lapsed lease
-- waiting for the reaper. A HANDED_OFF record becomes the reservation of the replacement
-- when the message names its handoffToken (a first start: attempt 0, its own call; the
-- handing owner's id gone, so that owner's late hand-off, write or end is refused); a
-- message that does not name the handoffToken a lease keeps is left alone (a copy of a
-- message from before the hand-off: it does not run).
--
-- Returns a list of codes, one per message: "reserved" | "left"
local now = now_ms()
local codes = {}
local mine = {}
for i = 3, #KEYS, 2 do
  local at = 2 + (i - 3) / 2 * 6
  local key = KEYS[i]
  local expires_at = now + tonumber(ARGV[at])
  local cur = redis.call('HMGET', key, 'status', 'handoffToken')
  local status = cur[1]
  if cur[2] and cur[2] ~= ARGV[at + 5] then
    codes[#codes + 1] = 'left'  -- a copy from before the hand-off
  elseif not status and finished_fence(KEYS[i + 1]) then
    codes[#codes + 1] = 'left'  -- finished: a copy received late
  elseif not status or status == 'HANDED_OFF' then
    -- A task never started, or the replacement's message after a hand-off: its reservation.
    local fields = {'status', 'RESERVED', 'reservedBy', ARGV[1], 'reservedAt', now,
      'leaseExpireAt', expires_at, 'taskName', ARGV[at + 1], 'maxTakeovers', ARGV[at + 3],
      'attempt', 0, 'takeovers', 0}
    if ARGV[at + 2] ~= '' then
      fields[#fields + 1] = 'call'
      fields[#fields + 1] = ARGV[at + 2]
    end
    if status then
      redis.call('PERSIST', key)  -- the record kept its publish id; it expires no more
      -- The owner that handed off owns nothing now: its token stays (no token handed out
      -- again is below it), its id goes, so nothing of it lands on the replacement's lease.
      redis.call('HDEL', key, 'ownerId')
    elseif ARGV[at + 4] ~= '' then
      fields[#fields + 1] = 'publishId'
      fields[#fields + 1] = ARGV[at + 4]
    end
    redis.call('HSET', key, unpack(fields))
    redis.call('ZADD', KEYS[1], expires_at, key)
    mine[#mine + 1] = expires_at
    mine[#mine + 1] = key
    codes[#codes + 1] = 'reserved'
  elseif status == 'RESERVED' or status == 'REQUEUED' then
    redis.call('HSET', key, 'status', 'RESERVED', 'reservedBy', ARGV[1], 'reservedAt', now,
      'leaseExpireAt', expires_at)
    redis.call('ZADD', KEYS[1], expires_at, key)
    mine[#mine + 1] = expires_at
    mine[#mine + 1] = key
    codes[#codes + 1] = 'reserved'
  else
    codes[#codes + 1] = 'left'
  end
end
if #mine > 0 then
  redis.call('ZADD', KEYS[2], unpack(mine))
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
return codes
