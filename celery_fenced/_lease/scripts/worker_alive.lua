-- worker_alive.lua: a worker's main process says it is alive (its liveness record).
--
-- A worker that dies takes the messages it received and did not start with it (its prefetch
-- buffer, its eta timers). While its record is renewed, its reservations wait for the start
-- timeout (a backlog); once the record lapses, lapse_worker.lua makes them due at once.
--
-- KEYS[1]  the workers: sorted set of worker id -> alive until (ms)
-- ARGV[1]  the worker's id ("<hostname>/<pid>/<start>": one start of the worker)
-- ARGV[2]  how long the record holds without renewal, ms
--
-- Returns the time the record holds until, ms.
local until_ms = now_ms() + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], int_arg(until_ms), ARGV[1])
return until_ms
