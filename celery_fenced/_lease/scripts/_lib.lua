-- _lib.lua: the functions several scripts share; the loader puts in front of each script
-- the ones it calls (a function defined and not called still costs each run a closure).
--
-- now_ms_text()                         the Redis server's clock, in milliseconds, as text
-- now_ms()                              the same as a number
-- now_us_text()                         the Redis server's clock, in microseconds, as text
-- int_arg(n)                            an integral Lua number as a command argument: Redis
--                                       writes a Lua number it is given with "%.17g", which
--                                       costs it several times the rest of a short command
-- write_result(key, meta, expires_ms)   Celery's own result write: SET (with PX when
--                                       expires_ms > 0) and PUBLISH, which wakes
--                                       AsyncResult.get()
-- owner_refusal(key, owner_id, token)   why an owner's call on the lease at key is refused
--                                       ("missing", "stale-token", "not-owner"), or nil,
--                                       and the lease's status; "missing" too for the
--                                       owner's lease written back given up after the
--                                       store lost it (lapseReason "data-lost"), and for
--                                       a live lease of an older token or a reservation
--                                       where the owner's was (written after the loss), and
--                                       for its own lease come back (came_back())
-- publish_progress(key, stored_version, now, stage, version, age_ms, details)
--                                       write an owner's progress: progressVersion,
--                                       lastProgressAt (server time minus the age the owner
--                                       reports) and currentStage ("" = unchanged) when its
--                                       version is newer than the stored one (read when
--                                       stored_version is nil), so a late call never moves
--                                       them back; details ("" = unchanged) whenever given
--                                       (the caller has checked the owner)
-- next_tokens(counter_key, n)           the last of n new tokens (INCRBY); a counter gone
--                                       while its epoch stayed (evicted, deleted) starts
--                                       again from the server's clock, as begin_epoch.lua
--                                       starts one, never from 1
-- this_primary()                        this server's replication id (master_replid) and
--                                       how many replicas it has connected; a promoted
--                                       replica, and a restarted server, take a new id
-- came_back(expire_at, primary, now)    true when an owner's RUNNING lease has run out (its
--                                       leaseExpireAt) on another server than the one it was
--                                       acquired or written back on (its primary, a
--                                       replication id; nil for a lease that recorded none):
--                                       a failover or a restart that kept the data may have
--                                       lost a claim of it and a newer owner's acquire, so the
--                                       owner's call is answered as if the lease were missing
--                                       (it gets it back only under restore.lua's rule);
--                                       now: the server's clock in ms, read when nil
-- in_token_epoch(epoch_key)             the epoch (this server's replication id) when the
--                                       token epoch was begun and confirmed on this server
--                                       (begin_epoch.lua), else nil: only then may a script
--                                       hand out a token
-- fence_of(meta)                        a finished lease's compact form: the token, the run
--                                       ("<publish id>/<attempt>/<takeovers>") and the state
--                                       of a READY result whose meta ends with its fence
--                                       ('..., "fence_run": "<run>", "fence_token": <token>}');
--                                       nil for any other value
-- finished_fence(result_key)            fence_of() of the stored result, nil without one
-- end_as_tombstone(key, fields)         end a lease as a DONE tombstone: only the fields a
--                                       finished lease is read for (who ended it, with which
--                                       token, which run, the hand-off it came from), plus the
--                                       given ones (a "status" given wins: the HANDED_OFF
--                                       record is such a tombstone); the recorded call,
--                                       progress and details go
-- undo_hand_off(key, prior)             take back the hand-off recorded at key: its five
--                                       fields go, the run's own hand-off token (prior, the
--                                       handoffPrior read by the caller; nil for none) is put
--                                       back as handoffToken, and the record's expiry goes;
--                                       the caller sets the status

local function now_ms_text()
  local t = redis.call('TIME')
  -- The seconds, then the milliseconds: the first three of the microseconds' six digits.
  -- Built as text: turning both parts into numbers costs more than the rest of TIME.
  return t[1] .. string.sub('00000' .. t[2], -6, -4)
end

local function now_ms()
  return tonumber(now_ms_text())
end

local function now_us_text()
  local t = redis.call('TIME')
  return t[1] .. string.sub('00000' .. t[2], -6)
end

local function this_primary()
  local info = redis.call('INFO', 'replication')
  return string.match(info, 'master_replid:(%x+)'), tonumber(string.match(info, 'connected_slaves:(%d+)') or '0')
end

local function came_back(expire_at, primary, now)
  if not primary or tonumber(expire_at or '0') >= (now or now_ms()) then
    return false
  end
  return primary ~= this_primary()
end

local function in_token_epoch(epoch_key)
  local epoch = redis.call('GET', epoch_key)
  -- A plain find: the replication id and the line's end, without a pattern's cost.
  if epoch and string.find(redis.call('INFO', 'replication'), 'master_replid:' .. epoch .. '\r\n', 1, true) then
    return epoch
  end
  return nil
end

local function int_arg(n)
  return string.format('%d', n)
end

local function next_tokens(counter_key, n)
  local last = redis.call('INCRBY', counter_key, n)
  if last == n then
    -- INCRBY made the counter: it was gone. Every token handed out before was at most the
    -- clock of its time (begin_epoch.lua), so the clock now is past them.
    last = tonumber(now_us_text()) + n
    redis.call('SET', counter_key, int_arg(last))
  end
  return last
end

local function write_result(key, meta, expires_ms)
  if expires_ms > 0 then
    redis.call('SET', key, meta, 'PX', int_arg(expires_ms))
  else
    redis.call('SET', key, meta)
  end
  redis.call('PUBLISH', key, meta)
end

local function owner_refusal(key, owner_id, token)
  local cur = redis.call('HMGET', key, 'status', 'ownerToken', 'ownerId', 'lapseReason', 'leaseExpireAt', 'primary')
  if not cur[1] then
    return 'missing', nil
  elseif cur[2] ~= token and cur[1] ~= 'DONE' and cur[1] ~= 'ABANDONED' and cur[1] ~= 'HANDED_OFF'
      and tonumber(cur[2] or '0') < tonumber(token) then
    -- An older token's lease (or a reservation, no token) where this owner's newer one was:
    -- written after the store lost this owner's (an older owner's write-back, a copy of the
    -- message received), as renew.lua answers it: the owner writes its own back first.
    return 'missing', cur[1]
  elseif cur[2] ~= token then
    return 'stale-token', cur[1]
  elseif cur[3] ~= owner_id then
    return 'not-owner', cur[1]
  elseif cur[4] == 'data-lost' then
    -- Its own lease, written back given up after the store lost it (restore.lua, "lapsed"),
    -- and perhaps claimed or put back since: a placeholder for the reaper, not a lease the
    -- owner holds (a newer owner's may have gone with it): nothing of the owner's lands on it.
    return 'missing', cur[1]
  elseif (cur[1] == 'RUNNING' or cur[1] == 'STALLED') and came_back(cur[5], cur[6]) then
    -- Its own lease, run out and come back with a failover (or a restart that kept the data)
    -- that may have lost a claim and a newer owner's lease: as missing.
    return 'missing', cur[1]
  end
  return nil, cur[1]
end

local function publish_progress(key, stored_version, now, stage, version, age, details)
  local fields = {}
  if version > 0 then
    if stored_version == nil then
      stored_version = redis.call('HGET', key, 'progressVersion')
    end
    if version > tonumber(stored_version or '0') then
      fields = {'progressVersion', int_arg(version), 'lastProgressAt', int_arg(now - age)}
      if stage ~= '' then
        fields[#fields + 1] = 'currentStage'
        fields[#fields + 1] = stage
      end
    end
  end
  if details ~= '' then
    fields[#fields + 1] = 'details'
    fields[#fields + 1] = details
  end
  if #fields > 0 then
    redis.call('HSET', key, unpack(fields))
  end
end

local function fence_of(meta)
  -- Only the tail is searched: the user's result, before it, is never read.
  local run, token = string.match(meta, '"fence_run": "([^"]*)", "fence_token": (%d+)}$', -120)
  if not token then
    -- A READY result fenced without its run (a cancel's REVOKED, an abandoned task's FAILURE,
    -- a publish id that cannot be carried): finished by that token all the same. Its DONE or
    -- ABANDONED lease says more, but a lease hash can be lost while its result stays.
    token = string.match(meta, '"fence_token": (%d+)}$', -40)
    if not token then
      return nil
    end
    run = ''
  end
  local state = string.match(meta, '^{"status": "(%u+)"')
  if state ~= 'SUCCESS' and state ~= 'FAILURE' and state ~= 'REVOKED' then
    return nil
  end
  return token, run, state
end

local function finished_fence(result_key)
  local meta = redis.call('GET', result_key)
  if not meta then
    return nil
  end
  return fence_of(meta)
end

local function end_as_tombstone(key, fields)
  local names = {'ownerId', 'ownerToken', 'attempt', 'takeovers', 'publishId', 'taskName', 'cancelledAt',
    'cancelledOwnerToken', 'successKept', 'handoffToken', 'handedOffAt'}
  local values = redis.call('HMGET', key, unpack(names))
  redis.call('DEL', key)
  local kept = {'status', 'DONE'}
  for i, name in ipairs(names) do
    if values[i] then
      kept[#kept + 1] = name
      kept[#kept + 1] = values[i]
    end
  end
  for _, item in ipairs(fields) do  -- after the kept ones: a field given here wins
    kept[#kept + 1] = item
  end
  redis.call('HSET', key, unpack(kept))
end

local function undo_hand_off(key, prior)
  redis.call('HDEL', key, 'handoffToken', 'handoffPrior', 'handedOffAt', 'handoffSent', 'handoffWorker')
  if prior then
    redis.call('HSET', key, 'handoffToken', prior)
  end
  redis.call('PERSIST', key)
end
