-- acquire.lua of the floor (benchmarks only): the least a script run before the body can do.
--
-- The same KEYS and ARGV as the package's acquire.lua (what the worker sends is unchanged);
-- it only takes a token. No lease is written: no owner, no expiry, no recorded call, no
-- index entry, no token epoch. What a task costs the server with this script and the floor's
-- store.lua is what any design that runs one script before the body and one for the result
-- costs at least.
return redis.call('INCR', KEYS[2])
