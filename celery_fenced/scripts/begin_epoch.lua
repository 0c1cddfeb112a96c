-- begin_epoch.lua: this server hands out tokens for the first time: move the token counter
-- past every token an earlier primary may have handed out.
--
-- Redis replicates asynchronously: a replica that Sentinel (or a managed service) promotes can
-- lack the last writes its primary acknowledged, the counter's increments among them, and a
-- server restarted from its append-only file can lack its last second. Both take a new
-- replication id (master_replid). The token epoch key names the server that hands out tokens
-- now; on any other server the scripts that hand out tokens refuse ("new-epoch") until this
-- script has moved the counter on by ARGV[1] (more tokens than a primary can hand out that its
-- replicas never receive) and confirm_epoch.lua has confirmed it, after the caller's WAIT saw
-- the replicas take the move: a replica promoted later has it, and jumps again from there.
--
-- KEYS[1]  token counter     <prefix>:token
-- KEYS[2]  token epoch       <prefix>:token:epoch: "<replid>" once confirmed, "<replid> begun"
--                            between this script and confirm_epoch.lua
-- ARGV[1]  the jump: how far the counter moves on
--
-- The counter moves only once per server, and not at all for a counter never used (no
-- token handed out yet: nothing to move past).
--
-- Returns {code, connected replicas}, the code one of:
--   "current"  the epoch is this server's and confirmed: nothing written
--   "moved"    this call moved the counter on
--   "begun"    another call moved it already, or the counter was never used
-- For "moved" and "begun" the epoch key was written on this call's connection, so a WAIT on
-- it waits for the move as well.
local replid, replicas = this_primary()
local epoch = redis.call('GET', KEYS[2])
if epoch == replid then
  return {'current', replicas}
end
local begun = replid .. ' begun'
local code = 'begun'
if epoch ~= begun and (epoch or tonumber(redis.call('GET', KEYS[1]) or '0') > 0) then
  redis.call('INCRBY', KEYS[1], ARGV[1])
  code = 'moved'
end
redis.call('SET', KEYS[2], begun)
return {code, replicas}
