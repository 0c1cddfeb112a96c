-- lapse.lua: the owner reports that its task stopped making progress, or that its body
-- stopped without finishing.
--
-- KEYS[1]  lease hash
-- KEYS[2]  expiry index
-- ARGV[1]  ownerId
-- ARGV[2]  ownerToken
-- ARGV[3]  mode: "release" (give the lease up now: LAPSED, due for takeover at once) or
--          "expire" (keep RUNNING but record the stall: the TTL runs out by itself, and the
--          takeover is then counted as cause "stalled", not "gone") or
--          "unfinished" (the body never finished: a cold shutdown cancelled it, or a
--          SystemExit or KeyboardInterrupt escaped it; LAPSED, due for takeover at once,
--          lapseReason "unfinished", no stall recorded: the takeover's cause is "gone")
-- ARGV[4..7] the owner's last progress, as renew.lua takes it: stage, progressVersion,
--          progress age ms, details (JSON, "" = unchanged); published before the stall is
--          recorded, so the next owner's checkpoint is the owner's latest
--
-- Returns {code}: "ok" | "stale-token" | "not-owner" | "not-running" | "missing"
local now = now_ms()
local refusal, status = owner_refusal(KEYS[1], ARGV[1], ARGV[2])
if refusal then
  return {refusal}
end
if status ~= 'RUNNING' and status ~= 'STALLED' then
  return {'not-running'}
end
if ARGV[4] then
  publish_progress(KEYS[1], nil, now, ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7])
end
if ARGV[3] == 'unfinished' then
  redis.call('ZADD', KEYS[2], now, KEYS[1])
  redis.call('HSET', KEYS[1], 'status', 'LAPSED', 'leaseExpireAt', now, 'lapsedAt', now,
    'lapseReason', 'unfinished')
  return {'ok'}
end
if ARGV[3] == 'release' then
  redis.call('ZADD', KEYS[2], now, KEYS[1])
  redis.call('HSET', KEYS[1], 'status', 'LAPSED', 'leaseExpireAt', now, 'lapsedAt', now,
    'lapseReason', 'stalled')
end
if not redis.call('HGET', KEYS[1], 'stalledAt') then
  redis.call('HSET', KEYS[1], 'stalledAt', now)
end
return {'ok'}
