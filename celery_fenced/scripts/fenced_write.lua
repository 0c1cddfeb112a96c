-- fenced_write.lua: write a user's key only if no newer fencing token wrote it.
--
-- Tokens are globally monotonic (one counter per key prefix), so a key written by
-- several task ids is fenced correctly too.
--
-- KEYS[1]  the user's key
-- KEYS[2]  its fence key (the token of the last accepted write)
-- ARGV[1]  the writer's token
-- ARGV[2]  the value
-- ARGV[3]  expiry in ms (0: none); the fence key gets the same
--
-- Returns {1, token} when written, {0, newer token} when refused.
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
local token = tonumber(ARGV[1])
if current > token then
  return {0, current}
end
local px = tonumber(ARGV[3])
if px > 0 then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', px)
  redis.call('SET', KEYS[2], token, 'PX', px)
else
  redis.call('SET', KEYS[1], ARGV[2])
  redis.call('SET', KEYS[2], token)
end
return {1, token}
