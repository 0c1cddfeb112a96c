-- trace_context.lua: keep the owner's run span context on its lease, so that the reaper's
-- re-send after a takeover can link to the attempt it replaces (only when that span records).
--
-- KEYS[1]  lease hash
-- ARGV[1]  the owner's fencing token
-- ARGV[2]  the span's W3C traceparent
--
-- Returns 1 when written, 0 when the lease is not this owner's live lease any more.
local held = redis.call('HMGET', KEYS[1], 'ownerToken', 'status')
if held[1] ~= ARGV[1] or (held[2] ~= 'RUNNING' and held[2] ~= 'STALLED') then
  return 0
end
redis.call('HSET', KEYS[1], 'traceContext', ARGV[2])
return 1
