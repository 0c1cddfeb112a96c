-- begin_epoch.lua: this server hands out tokens for the first time: move the token counter
-- past every token an earlier server (or this one, before it lost its data) handed out.
--
-- Redis replicates asynchronously: a replica that Sentinel (or a managed service) promotes can
-- lack the last writes its primary acknowledged, the counter's increments among them, or the
-- counter itself (a first failover); a server restarted from its append-only file can lack its
-- last second, one that keeps no data loses the counter, and so does a FLUSHDB. A promoted or
-- restarted server takes a new replication id (master_replid); a FLUSHDB deletes the epoch key
-- with the counter. The token epoch key names the server that hands out tokens now; on any
-- other server, or without the key, the scripts that hand out tokens refuse ("new-epoch")
-- until this script has moved the counter on and confirm_epoch.lua has confirmed it, after the
-- caller's WAIT saw the replicas take the move.
--
-- The move is to the server's clock, in microseconds (TIME): the counter becomes at least the
-- clock's reading. Tokens are handed out far slower than one a microsecond, so every token a
-- counter started (or moved) this way handed out was at most the clock of its server when it
-- was handed out: the clock now is past them, as long as it has not stepped back (the one
-- assumption: docs/guarantees.rst, "Tokens"). A counter above the clock (a clock that stepped
-- back, a counter moved moments ago) stays: tokens never go back. The reading is below 2^53 (a
-- Lua number holds it exactly) until the year 2255.
--
-- KEYS[1]  token counter     <prefix>:token
-- KEYS[2]  token epoch       <prefix>:token:epoch: "<replid>" once confirmed, "<replid> begun"
--                            between this script and confirm_epoch.lua
--
-- Returns {code, connected replicas}, the code one of:
--   "current"  the epoch is this server's and confirmed: nothing written
--   "moved"    this call moved a counter that handed out tokens before to the clock
--   "begun"    another call moved it already, the counter started from the clock (none
--              was there: a new deployment, a FLUSHDB, a server that lost its data), or
--              the counter was above the clock already
-- For "moved" and "begun" the epoch key was written on this call's connection, so a WAIT on
-- it waits for the move as well.
local replid, replicas = this_primary()
local epoch = redis.call('GET', KEYS[2])
if epoch == replid then
  return {'current', replicas}
end
local begun = replid .. ' begun'
local code = 'begun'
if epoch ~= begun then
  local counter = redis.call('GET', KEYS[1])
  local clock = now_us_text()
  if not counter or tonumber(counter) < tonumber(clock) then
    redis.call('SET', KEYS[1], clock)
    if counter and tonumber(counter) > 0 then
      code = 'moved'
    end
  end
end
redis.call('SET', KEYS[2], begun)
return {code, replicas}
