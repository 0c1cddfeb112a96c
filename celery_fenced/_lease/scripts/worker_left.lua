-- worker_left.lua: a worker stopped (a warm shutdown): its liveness record goes.
--
-- The broker takes back the messages a stopping worker did not start (kombu restores them
-- to the queue), and the worker writes its unstarted reservations on the way out: they are
-- sent again after the start timeout only if the broker did not deliver them again first.
--
-- KEYS[1]  the workers: sorted set of worker id -> alive until (ms)
-- KEYS[2]  the worker's reservations
-- ARGV[1]  the worker's id ("<hostname>/<pid>/<start>": one start of the worker)
--
-- Returns the number of records removed (0 or 1).
redis.call('DEL', KEYS[2])
return redis.call('ZREM', KEYS[1], ARGV[1])
