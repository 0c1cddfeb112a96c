-- _lib.lua: the functions several scripts share; the loader puts them in front of each script.
--
-- now_ms()                              the Redis server's clock, in milliseconds
-- write_result(key, meta, expires_ms)   Celery's own result write: SET (with PX when
--                                       expires_ms > 0) and PUBLISH, which wakes
--                                       AsyncResult.get()
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
