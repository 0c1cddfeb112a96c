-- store.lua of the floor (benchmarks only): Celery's own result write, and nothing else.
--
-- The same KEYS and ARGV as the package's store.lua. It writes the result as Celery's
-- Redis backend does (SET with the result expiry, then PUBLISH, which wakes
-- AsyncResult.get()) and answers "stored, the lease ended": no token is checked and no
-- lease is ended.
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[5])
redis.call('PUBLISH', KEYS[2], ARGV[2])
return 1
