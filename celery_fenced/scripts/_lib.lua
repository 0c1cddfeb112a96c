-- _lib.lua: the functions several scripts share; the loader puts them in front of each script.
--
-- now_ms()                              the Redis server's clock, in milliseconds
-- write_result(key, meta, expires_ms)   Celery's own result write: SET (with PX when
--                                       expires_ms > 0) and PUBLISH, which wakes
--                                       AsyncResult.get()
-- owner_refusal(key, owner_id, token)   why an owner's call on the lease at key is refused
--                                       ("missing", "stale-token", "not-owner"), or nil,
--                                       and the lease's status
redis.replicate_commands()

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function write_result(key, meta, expires_ms)
  if expires_ms > 0 then
    redis.call('SET', key, meta, 'PX', expires_ms)
  else
    redis.call('SET', key, meta)
  end
  redis.call('PUBLISH', key, meta)
end

local function owner_refusal(key, owner_id, token)
  local cur = redis.call('HMGET', key, 'status', 'ownerToken', 'ownerId')
  if not cur[1] then
    return 'missing', nil
  elseif cur[2] ~= token then
    return 'stale-token', cur[1]
  elseif cur[3] ~= owner_id then
    return 'not-owner', cur[1]
  end
  return nil, cur[1]
end
