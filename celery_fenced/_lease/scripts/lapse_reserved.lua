-- lapse_reserved.lua: a worker lost its broker connection and with it the messages it held
-- unstarted: make their reservations due now, so the reaper sends them again at once.
--
-- KEYS[1]    expiry index
-- KEYS[2]    the worker's reservations: sorted set of lease key -> reservation due (ms)
-- KEYS[3..]  the lease hashes of the tasks the worker reserved and did not start
-- ARGV[1]    reservedBy: that worker's hostname
--
-- Only a lease still RESERVED by this worker changes: one another worker reserved since, or
-- one that started, is left alone. Every one leaves the worker's reservations: the worker
-- holds none of them any more (the index has those made due).
--
-- Returns the number of reservations made due.
local now = now_ms()
local count = 0
for i = 3, #KEYS do
  redis.call('ZREM', KEYS[2], KEYS[i])
  local f = redis.call('HMGET', KEYS[i], 'status', 'reservedBy')
  if f[1] == 'RESERVED' and f[2] == ARGV[1] then
    redis.call('HSET', KEYS[i], 'leaseExpireAt', now)
    redis.call('ZADD', KEYS[1], now, KEYS[i])
    count = count + 1
  end
end
return count
