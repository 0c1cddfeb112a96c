-- acquire.lua: take the lease of a task for one execution (an "attempt").
--
-- KEYS[1]  lease hash        <prefix>:lease:{<result key>}
-- KEYS[2]  token counter     <prefix>:token (global, never expires)
-- KEYS[3]  expiry index      <prefix>:leases (sorted set, a hint for the reaper)
-- KEYS[4]  token epoch       <prefix>:token:epoch (the primary that hands out tokens now)
-- KEYS[5]  Celery's result key (a finished task's lease lives on in it: fence_of())
-- ARGV[1]  ownerId           "<hostname>/<pid>/<attempt id>", unique per execution
-- ARGV[2]  lease ttl, ms
-- ARGV[3]  taskName
-- ARGV[4]  the original call (JSON of signature_from_request()), may be ""
-- ARGV[5]  maxTakeovers for this task
-- ARGV[6]  initial stage, may be ""
-- ARGV[7]  the publish id of the delivery's message (one per apply_async, kept by the reaper's
--          re-sends), may be ""
-- ARGV[8]  the token the delivery's message says the task id was handed off from (a
--          replacement sent by Task.replace(): the fenced_handed_off_by header), may be ""
-- ARGV[9]  optional (task_track_started): Celery's STARTED meta for the run, as the fenced
--          backend encodes it, without its end: a run that takes the lease stores it as its
--          result, ending ', "fence_token": <its token>}', as the backend's STARTED write
--          would (one call instead of two); not over a SUCCESS Celery keeps (successKept)
-- ARGV[10] with ARGV[9]: that result's expiry, ms (0: none)
--
-- A hand-off (release.lua) leaves a HANDED_OFF record whose handoffToken the replacement's
-- message names: that message runs (a new run of the task id, attempt 1), any other does not
-- ("handed-off"). Once the replacement runs, its lease keeps the handoffToken: a delivery of
-- the same run (same publish id, or none) that does not name it is a copy of a message from
-- before the hand-off and does not run either, live lease or not.
--
-- An attempt that asks again (same ownerId: its reply was lost) gets "new" or "takeover" again.
--
-- The checkpoint: a takeover (and a retry, which is the same task id) gets the last progress an
-- earlier owner published, as JSON {"stage", "details", "attempt", "token"}, kept in the
-- `checkpoint` field: the previous owner's stage and details when it published progress,
-- else the checkpoint it was given itself. "" when no owner published any.
--
-- Returns "new-epoch", having written nothing, on a server that has not begun the token epoch
-- (a promoted replica, a restarted server: begin_epoch.lua, then ask again). Otherwise the
-- new token alone, an integer, for a first delivery (no lease: the common case,
-- "new" with attempt 1 and no takeovers; a table would cost the server more than the rest
-- of that path), and otherwise {code, previous status or "", the lease's snapshot() as a
-- flat list (who holds it, for a delivery that does not run), checkpoint}, the code one of:
--   "new"        only the reservation of a task never started (RESERVED, or REQUEUED after
--                it was sent again): token taken, attempt 1 (as for no lease, above)
--   "takeover"   the lease was LAPSED, REQUEUED, RETRYING or had expired, or a reservation
--                of a task that ran before: new token, attempt + 1
--   "duplicate"  a live owner holds it (RUNNING or STALLED, not expired): do not run
--   "done"       a result was stored, or the owner ended the task: do not run. A delivery
--                of another publish (the task id applied again, as Celery allows: a frozen
--                signature re-applied) starts a new run instead, answered "new"; a cancelled
--                task and a delivery without a publish id are never run again
--   "abandoned"  taken over too often: do not run
--   "handed-off" the task id was handed to a replacement, and this is not its message: do
--                not run

-- The server the lease is acquired on (its epoch: its replication id): a lease that runs out
-- on another server may have come back with a failover (_lib.lua's came_back).
local primary = in_token_epoch(KEYS[4])
if not primary then
  return 'new-epoch'
end

local now_arg = now_ms_text()
local now = tonumber(now_arg)
local expire_arg = int_arg(now + tonumber(ARGV[2]))
local publish_id = ARGV[7] or ''
-- Neither a lease nor a result: a first delivery. A finished task has a result and, most
-- often, no lease: its result carries the fence (store.lua).
local found = redis.call('EXISTS', KEYS[1], KEYS[5])

if found == 0 and ARGV[4] ~= '' and publish_id ~= '' then
  -- The common case, a first delivery: one write, and the answer is known without a read.
  -- The fields of owner_fields(token), new_run_fields() and the counts, written out:
  -- building the table would cost the server as much as a third of this write.
  local token = next_tokens(KEYS[2], 1)
  redis.call('HSET', KEYS[1], 'status', 'RUNNING', 'ownerId', ARGV[1], 'ownerToken', int_arg(token),
    'currentStage', ARGV[6], 'progressVersion', '0', 'heartbeatAt', now_arg, 'lastProgressAt', now_arg,
    'leaseExpireAt', expire_arg, 'leaseTtl', ARGV[2], 'taskName', ARGV[3], 'maxTakeovers', ARGV[5],
    'call', ARGV[4], 'publishId', publish_id, 'attempt', '1', 'takeovers', '0', 'primary', primary)
  redis.call('ZADD', KEYS[3], expire_arg, KEYS[1])
  if ARGV[9] then
    local started, expires = ARGV[9] .. ', "fence_token": ' .. int_arg(token) .. '}', tonumber(ARGV[10])
    write_result(KEYS[5], started, expires)
  end
  return token
end

-- Defined past the common case, which returns above: each function defined is a closure
-- made by every run that reaches its definition.

-- The owner needs only these fields back (not the recorded call, which can be large).
local function snapshot()
  local names = {'status', 'ownerId', 'ownerToken', 'attempt', 'takeovers', 'leaseExpireAt',
    'currentStage', 'taskName'}
  local values = redis.call('HMGET', KEYS[1], unpack(names))
  local out = {}
  for i, name in ipairs(names) do
    if values[i] then
      out[#out + 1] = name
      out[#out + 1] = values[i]
    end
  end
  return out
end

-- What every acquire writes for its owner (attempt and takeovers are counted apart).
local function owner_fields(token)
  local fields = {
    'status', 'RUNNING',
    'ownerId', ARGV[1],
    'ownerToken', int_arg(token),
    'currentStage', ARGV[6],
    'progressVersion', '0',
    'heartbeatAt', now_arg,
    'lastProgressAt', now_arg,
    'leaseExpireAt', expire_arg,
    'leaseTtl', ARGV[2],
    'taskName', ARGV[3],
    'maxTakeovers', ARGV[5],
    'primary', primary}
  if ARGV[4] ~= '' then
    fields[#fields + 1] = 'call'
    fields[#fields + 1] = ARGV[4]
  end
  return fields
end

-- A new run (a first delivery, or the task id applied again) remembers its publish id.
local function new_run_fields(fields)
  if publish_id ~= '' then
    fields[#fields + 1] = 'publishId'
    fields[#fields + 1] = publish_id
  end
  return fields
end

local exists = found > 0 and redis.call('EXISTS', KEYS[1]) == 1
local compact = false
if not exists and found > 0 then
  local fence, run, state = finished_fence(KEYS[5])
  if fence then
    -- A finished task, its lease kept in its result: written back as the DONE lease it was,
    -- for what follows (deleted again unless a delivery of another publish runs it again).
    local publish, attempt, takeovers = string.match(run, '^(.*)/(%d+)/(%d+)$')
    redis.call('HSET', KEYS[1], 'status', 'DONE', 'ownerToken', fence, 'attempt', attempt or '1',
      'takeovers', takeovers or '0', 'resultState', state)
    if publish and publish ~= '' then
      redis.call('HSET', KEYS[1], 'publishId', publish)
    end
    exists = true
    compact = true
  end
end

if not exists then
  -- A first delivery without a recorded call or a publish id, or whose result is not a
  -- finished lease's (a plain task's, or left by a lease that vanished).
  local token = next_tokens(KEYS[2], 1)
  local fields = new_run_fields(owner_fields(token))
  fields[#fields + 1] = 'attempt'
  fields[#fields + 1] = '1'
  fields[#fields + 1] = 'takeovers'
  fields[#fields + 1] = '0'
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('ZADD', KEYS[3], expire_arg, KEYS[1])
  return token
end

local cur = redis.call('HMGET', KEYS[1], 'status', 'handoffToken', 'publishId')
local status = cur[1]
local code = 'new'
if status == 'RUNNING' and redis.call('HGET', KEYS[1], 'ownerId') == ARGV[1] then
  -- The same attempt asking again (its reply was lost to a connection error): the same answer.
  local again = 'new'
  if tonumber(redis.call('HGET', KEYS[1], 'attempt') or '1') > 1 then
    again = 'takeover'
  end
  return {again, '', snapshot(), redis.call('HGET', KEYS[1], 'checkpoint') or ''}
end
local rerun = false
local replacement = false
if cur[2] and status ~= 'DONE' and status ~= 'ABANDONED' then  -- a finished run: as below
  local handed_by = ARGV[8] or ''
  if status == 'HANDED_OFF' then
    if handed_by ~= cur[2] then
      return {'handed-off', status, snapshot()}
    end
    replacement = true  -- the replacement's message: its first start
  elseif handed_by ~= cur[2] and (publish_id == '' or not cur[3] or cur[3] == publish_id) then
    return {'handed-off', status, snapshot()}  -- a copy of the run's message from before the hand-off
  end
end
if replacement then
  -- A new run: counted from 1, nothing of the replaced run handed on.
  redis.call('HSET', KEYS[1], 'attempt', 0, 'takeovers', 0)
  rerun = true
elseif status then
  if status == 'DONE' then
    local run = redis.call('HMGET', KEYS[1], 'publishId', 'cancelledAt')
    if publish_id == '' or not run[1] or run[1] == publish_id or run[2] then
      local held = snapshot()
      if compact then
        redis.call('DEL', KEYS[1])
      end
      return {'done', status, held}
    end
    rerun = true
  elseif status == 'ABANDONED' then
    return {'abandoned', status, snapshot()}
  elseif status == 'RUNNING' or status == 'STALLED' then
    local expire_at = tonumber(redis.call('HGET', KEYS[1], 'leaseExpireAt') or '0')
    if expire_at > now then
      return {'duplicate', status, snapshot()}
    end
  end
  code = 'takeover'
  if status == 'RESERVED' or status == 'REQUEUED' then
    redis.call('HDEL', KEYS[1], 'reservedBy', 'reservedAt')
    if tonumber(redis.call('HGET', KEYS[1], 'attempt') or '0') == 0 then
      -- Received (and perhaps sent again) but never started: this is its first start.
      code = 'new'
      status = ''
    end
  end
else
  status = ''
end
if rerun then
  code = 'new'
  status = ''
end

-- The checkpoint, read before the new owner's fields overwrite the previous owner's.
local checkpoint = ''
if code == 'takeover' then
  local prev = redis.call('HMGET', KEYS[1], 'progressVersion', 'currentStage', 'details', 'attempt',
    'ownerToken', 'checkpoint')
  if tonumber(prev[1] or '0') > 0 then
    -- Built as text: the details stay the owner's JSON, byte for byte (cjson would round numbers).
    checkpoint = '{"stage":' .. cjson.encode(prev[2] or '') .. ',"details":' .. (prev[3] or '{}') ..
      ',"attempt":' .. (prev[4] or '0') .. ',"token":' .. (prev[5] or '0') .. '}'
    redis.call('HSET', KEYS[1], 'checkpoint', checkpoint)
  else
    checkpoint = prev[6] or ''
  end
elseif rerun then
  -- Another publish of the task id runs from the start: nothing of the earlier run is handed on.
  redis.call('HDEL', KEYS[1], 'checkpoint', 'details')
end

local token = next_tokens(KEYS[2], 1)
local held = tonumber(redis.call('HGET', KEYS[1], 'ownerToken') or '0')
if token <= held then
  -- The counter moved back (a restart that lost writes): never hand out a token again.
  token = held + 1
  redis.call('SET', KEYS[2], token)
end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSETNX', KEYS[1], 'takeovers', 0)
redis.call('HDEL', KEYS[1], 'stalledAt', 'lapseReason', 'lapsedAt', 'resends', 'traceContext', 'handoffPrior',
  'handoffSent', 'handoffWorker')
if rerun then
  -- Celery keeps a stored SUCCESS: the new run's writes are not stored over it (store.lua).
  if redis.call('HGET', KEYS[1], 'resultState') == 'SUCCESS' then
    redis.call('HSET', KEYS[1], 'successKept', 1)
  end
  redis.call('HDEL', KEYS[1], 'finishedAt', 'resultState')
  if not replacement then
    redis.call('HDEL', KEYS[1], 'handoffToken', 'handedOffAt')  -- another publish: not the hand-off's run
  end
  redis.call('HSET', KEYS[1], 'takeovers', 0, unpack(new_run_fields(owner_fields(token))))
else
  redis.call('HSET', KEYS[1], unpack(owner_fields(token)))
end
redis.call('PERSIST', KEYS[1])
redis.call('ZADD', KEYS[3], expire_arg, KEYS[1])
if ARGV[9] and not redis.call('HGET', KEYS[1], 'successKept') then
  local started, expires = ARGV[9] .. ', "fence_token": ' .. int_arg(token) .. '}', tonumber(ARGV[10])
  write_result(KEYS[5], started, expires)
end
return {code, status, snapshot(), checkpoint}
