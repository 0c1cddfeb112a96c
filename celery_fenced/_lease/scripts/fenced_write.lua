-- fenced_write.lua: write a user's key only if no newer fencing token wrote it.
--
-- Tokens are globally monotonic (one counter per key prefix), so a key written by
-- several task ids is fenced correctly too. A key with no fence yet is written by any
-- token. The fence outlives the value: it gets no expiry unless ARGV[4] gives one, and
-- a write never shortens a fence's life (a stale owner writing after the value expired
-- is still refused).
--
-- KEYS[1]  the user's key
-- KEYS[2]  its fence key (the token of the last accepted write)
-- ARGV[1]  the writer's token
-- ARGV[2]  the value
-- ARGV[3]  expiry of the value in ms (0: none)
-- ARGV[4]  expiry of the fence in ms (0: none); never below ARGV[3]
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
else
  redis.call('SET', KEYS[1], ARGV[2])
end
local fence_px = tonumber(ARGV[4])
local fence_ttl = redis.call('PTTL', KEYS[2])  -- -2: no fence, -1: no expiry
if fence_px == 0 or fence_ttl == -1 then
  redis.call('SET', KEYS[2], token)
elseif fence_ttl > fence_px then
  redis.call('SET', KEYS[2], token, 'PX', fence_ttl)  -- it lives longer already: keep that
else
  redis.call('SET', KEYS[2], token, 'PX', fence_px)
end
return {1, token}
