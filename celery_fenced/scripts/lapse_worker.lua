-- lapse_worker.lua: a worker's liveness record lapsed (worker_alive.lua): make the
-- reservations it still holds due now, so the reaper sends them again at once.
--
-- KEYS[1]  the workers: sorted set of worker id -> alive until (ms)
-- KEYS[2]  expiry index
-- KEYS[3]  the worker's reservations: sorted set of lease key -> reservation due (ms)
-- ARGV[1]  the worker's id ("<hostname>/<pid>/<start>": one start of the worker)
-- ARGV[2]  its hostname (its reservations' reservedBy)
--
-- Only a lease still RESERVED by this worker's hostname changes: one that started, or that
-- another worker reserved since, is left alone. The record and the worker's reservations set go.
--
-- Returns {code, reservations made due}, the code one of:
--   "lapsed"  the record had lapsed: done
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
for _, key in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  local f = redis.call('HMGET', key, 'status', 'reservedBy')
  if f[1] == 'RESERVED' and f[2] == ARGV[2] then
    redis.call('HSET', key, 'leaseExpireAt', now)
    redis.call('ZADD', KEYS[2], now, key)
    count = count + 1
  end
end
redis.call('DEL', KEYS[3])
redis.call('ZREM', KEYS[1], ARGV[1])
return {'lapsed', count}
