-- confirm_epoch.lua: the token counter's move (begin_epoch.lua) reached the replicas: this
-- server may hand out tokens.
--
-- KEYS[1]  token epoch       <prefix>:token:epoch
--
-- Returns {code}:
--   "confirmed"  this server's epoch is confirmed (now, or before)
--   "other"      the key names no epoch begun on this server (a failover since
--                begin_epoch.lua): begin again
local replid = this_primary()
local epoch = redis.call('GET', KEYS[1])
if epoch == replid then
  return {'confirmed'}
elseif epoch == replid .. ' begun' then
  redis.call('SET', KEYS[1], replid)
  return {'confirmed'}
end
return {'other'}
