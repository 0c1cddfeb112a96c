-- lapse_worker.lua: a worker's liveness record lapsed (worker_alive.lua): make the
-- reservations it still holds due now, so the reaper sends them again at once, and so the
-- hand-offs its processes made and did not say they sent (release.lua, replacement_sent.lua).
--
-- KEYS[1]     the workers: sorted set of worker id -> alive until (ms)
-- KEYS[2]     expiry index
-- KEYS[3]     the worker's reservations: sorted set of lease key -> reservation due (ms)
-- KEYS[4..n]  lease hashes: the members of KEYS[3] as the caller read them (ZRANGE), so every
--             key the script touches is named here (an ACL key pattern, a proxy that routes
--             by key); one the set no longer holds is left alone
-- ARGV[1]     the worker's id ("<hostname>/<pid>/<start>": one start of the worker)
-- ARGV[2]     its hostname (its reservations' reservedBy)
--
-- Only a lease still RESERVED by this worker's hostname changes: one that started, or that
-- another worker reserved since, is left alone. A HANDED_OFF record changes only while it is
-- this worker's hand-off (handoffWorker) not said sent: it is lapsed as store.lua lapses the
-- hand-off of a lost process ("worker-lost", due now), for claim.lua to undo and take over.
-- Each lease given leaves the worker's set; once the set is empty, the set and the record go.
--
-- Returns {code, reservations made due}, the code one of:
--   "lapsed"  the record had lapsed: done
--   "more"    the record had lapsed, and the set holds leases not given (added after the
--             caller read it, or more than one call takes): the caller reads it again and
--             calls again; the record stays until then
--   "alive"   the record holds (renewed meanwhile): nothing written
--   "unknown" no record (another reaper lapsed it, or the worker stopped): nothing written
local now = now_ms()
local alive_until = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not alive_until then
  return {'unknown', 0}
end
if tonumber(alive_until) > now then
  return {'alive', 0}
end
local count = 0
for i = 4, #KEYS do
  local key = KEYS[i]
  if redis.call('ZREM', KEYS[3], key) == 1 then
    local f = redis.call('HMGET', key, 'status', 'reservedBy', 'handoffWorker', 'handoffSent')
    if f[1] == 'RESERVED' and f[2] == ARGV[2] then
      redis.call('HSET', key, 'leaseExpireAt', now)
      redis.call('ZADD', KEYS[2], now, key)
      count = count + 1
    elseif f[1] == 'HANDED_OFF' and f[3] == ARGV[1] and f[4] ~= '1' then
      redis.call('HSET', key, 'leaseExpireAt', now, 'lapsedAt', now, 'lapseReason', 'worker-lost')
      redis.call('ZADD', KEYS[2], now, key)
      count = count + 1
    end
  end
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return {'more', count}
end
redis.call('ZREM', KEYS[1], ARGV[1])
return {'lapsed', count}
