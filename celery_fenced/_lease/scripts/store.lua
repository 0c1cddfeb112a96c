-- store.lua: write a task's result only if the writer's fencing token is current.
--
-- It does what Celery's Redis backend does for a write (SET with the result expiry, then
-- PUBLISH on the result key, which wakes AsyncResult.get()), and moves the lease in the
-- same atomic step: a READY state ends it (DONE), RETRY makes it RETRYING.
--
-- KEYS[1]  lease hash
-- KEYS[2]  Celery's result key
-- KEYS[3]  expiry index
-- ARGV[1]  writer's token; "" for a tokenless write from the worker's main process
-- ARGV[2]  encoded result meta (already carrying fence_token)
-- ARGV[3]  state (SUCCESS, FAILURE, REVOKED, RETRY, STARTED or a custom state)
-- ARGV[4]  kind: "ready" (READY_STATES), "retry", or "other"
-- ARGV[5]  result expiry, ms (0: none); a DONE lease lives exactly as long
-- ARGV[6]  writes with a token: the writer's ownerId (an equal token of another owner, after
--          a restart that moved the token counter back, is not current); may be ""
-- ARGV[7]  RETRYING: ms until the reaper may re-send (retry eta + requeue timeout); only
--          for a RETRY write; REQUEUED (ARGV[9] "2"): ms until the reaper may re-send
-- ARGV[8]  tokenless writes: "<hostname>/<pid>/", the owner-id prefix of the process that
--          ran the task; "" or absent when no process ran it (a copy revoked or expired
--          unstarted)
-- ARGV[9]  tokenless writes: "1" when the write says the owner's body stopped unfinished
--          (a WorkerLostError, or the RETRY Celery writes for a request it cancelled in a
--          cold shutdown), "2" for a READY write after which Celery puts the message back
--          to run the task again (a hard time limit with task_acks_late and
--          acks_on_failure_or_timeout off): written, and a live or LAPSED lease is left
--          REQUEUED for that message (as Reject(requeue=True) leaves it), not ended; else "0"
--          or absent
-- ARGV[10] tokenless writes: the token the writer's message says the task id was handed off
--          from (its fenced_handed_off_by header), "" or absent when none
--
-- A HANDED_OFF record (release.lua) refuses every token: an older one as "stale", the one
-- that handed off as "finished" (its run ended with the hand-off: a late write of it would
-- take the place of the replacement's result and keep the replacement from running as the
-- task id's run). A tokenless write there is stored only for the replacement (its message names
-- the record's handoffToken: a replacement that is not a fenced task), as without a lease,
-- and a READY one ends the record as a DONE tombstone; any other tokenless write comes from
-- the run that handed off (its worker's main process) and is refused ("foreign").
--
-- The arguments past the last one a write needs are left out (each argument costs the
-- server as much as a short command's own work): a token's READY write sends six.
--
-- A writer whose READY write ended the lease gets "stored" again for the same token, state
-- and result (its reply was lost and it asks again); nothing is written twice.
--
-- A READY result that carries its fence (a token's write whose meta ends with fence_run and
-- fence_token: fence_of()) ends the lease by deleting it: the result is then the finished
-- lease's compact form, and refuses a late write for exactly as long as it exists. Any
-- other READY write (a tokenless REVOKED, a result serializer other than JSON) leaves a DONE
-- tombstone (end_as_tombstone()) that lives as long as the result.
--
-- Returns 1 for a READY result stored that ended the lease ("stored" with detail "DONE", the
-- common case: a table would cost the server more than the lease's own write), and
-- otherwise {code, detail}:
--   "stored"    written (detail: the lease status after, "" without a lease)
--   "stale"     refused: a newer token owns the task (detail: the current token)
--   "finished"  refused: the lease already ended (DONE or ABANDONED), or was handed off
--   "missing"   refused: a write with a token finds neither a lease nor a finished result
--               (fence_of()) that refuses it: its lease vanished (data loss), and a newer
--               owner's may have vanished with it; or finds its own lease written back given
--               up after that (lapseReason "data-lost"), or a live lease of an older token or
--               a reservation where its own was (written after the loss), or its own lease run
--               out and come back with a failover (came_back()). Nothing written;
--               the owner writes its lease back (restore.lua) and asks again, or stores nothing
--   "lapsed"    a tokenless WorkerLostError (or cancel) of the current owner: nothing
--               written, the lease is LAPSED so the reaper takes the task over at once; of
--               the process that handed a HANDED_OFF record off: nothing written, the record
--               is due after ARGV[7] ms, for the reaper to take the task over if the
--               replacement has not started by then (it may never have been sent; one its
--               owner said it sent, replacement_sent.lua, is "foreign")
--   "foreign"   refused: a tokenless write not from the owner's process, while an owner
--               is live (RUNNING, STALLED) or for a state other than REVOKED (a READY state
--               of the process that handed a HANDED_OFF record off, not said sent, undoes the
--               hand-off and is that owner's end: stored, or REQUEUED when put back); a FAILURE
--               of a RESERVED lease (a delivery that could not take it) from a pool
--               process or from the host that reserved it is its owner's
--   "sticky"    not written: a SUCCESS is already stored (Celery's own rule), with no lease,
--               or for a task id applied again after it (detail "kept"; a READY state still
--               ends that run's lease)
local token, meta, state, kind = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local expires = tonumber(ARGV[5])

local cur = redis.call('HMGET', KEYS[1], 'status', 'ownerToken', 'ownerId', 'successKept', 'takeovers', 'lapseReason',
  'leaseExpireAt', 'primary')
local status = cur[1]

if status == 'DONE' and token ~= '' and cur[2] == token
    and redis.call('HGET', KEYS[1], 'resultState') == state and redis.call('GET', KEYS[2]) == meta then
  -- The writer that ended the lease asking again with the same result (its reply was lost
  -- to a connection error): the same answer, so its chord, chain and errback side effects
  -- still run. Nothing is written twice.
  return 1
end

if not status then
  -- No lease: a finished task (its result carries the fence), a plain task, or a fenced one
  -- whose lease is gone.
  local old = redis.call('GET', KEYS[2])
  if old then
    local fence = fence_of(old)
    if fence then
      if token ~= '' and fence == token and old == meta then
        return 1  -- the writer that ended it, asking again with the same result
      elseif token ~= '' and tonumber(token) < tonumber(fence) then
        return {'stale', fence}
      elseif token == '' or token == fence then
        return {'finished', 'DONE'}
      end
      -- A newer token: a later run of the task id whose lease is gone (below).
    end
    -- Keep Celery's rule that a stored SUCCESS is final, but check it atomically.
    local ok, decoded = pcall(cjson.decode, old)
    if ok and type(decoded) == 'table' and decoded['status'] == 'SUCCESS' then
      return {'sticky', ''}
    end
  end
  if token ~= '' then
    -- A token's lease is gone while its task is not finished: the lease store lost data (a
    -- FLUSHDB, a restart without persistence, a failover that lost writes, an eviction), and
    -- with it, perhaps, a newer owner's lease. Nothing is written: the owner gets its lease
    -- back first (restore.lua: only while its last renewal is less than a TTL ago), then
    -- writes again; a thawed owner never does.
    return {'missing', ''}
  end
  write_result(KEYS[2], meta, expires)
  return {'stored', ''}
end

if token ~= '' then
  local owner_id = ARGV[6] or ''
  if cur[2] ~= token and status ~= 'DONE' and status ~= 'ABANDONED' and status ~= 'HANDED_OFF'
      and tonumber(cur[2] or '0') < tonumber(token) then
    -- An older token's lease, or a reservation (no token), where the writer's newer one was:
    -- written after the store lost the writer's lease (an older owner's write-back, a copy of
    -- the message received). Not a newer owner: as missing (renew.lua answers it so too), the
    -- writer writes its own lease back over it (restore.lua: the newer token wins) and asks
    -- again. Refused as stale, the current owner would lose its task to a thawed one.
    return {'missing', ''}
  end
  if cur[2] ~= token or (owner_id ~= '' and cur[3] ~= owner_id and cur[3] ~= '') then
    return {'stale', cur[2] or ''}
  end
  if cur[6] == 'data-lost' then
    -- The owner's own lease, written back given up after the store lost it (restore.lua,
    -- "lapsed"; claimed or put back since, perhaps): a newer owner's lease may have gone with
    -- it, and that owner writes its own back within the TTL this one waits. It is a
    -- placeholder for the reaper, not a lease the owner holds: its write is refused as its
    -- vanished lease's was.
    return {'missing', ''}
  end
  if (status == 'RUNNING' or status == 'STALLED') and came_back(cur[7], cur[8]) then
    -- The owner's own lease, run out, on another server than the one it was acquired or
    -- written back on (a failover, a restart that kept the data): the claim of it and a newer
    -- owner's acquire may have been lost with the old server. As missing: the owner gets it
    -- back only under restore.lua's rule (a thawed owner never does).
    return {'missing', ''}
  end
else
  if status == 'DONE' or status == 'ABANDONED' then
    return {'finished', status}
  end
  if status == 'HANDED_OFF' then
    local h = redis.call('HMGET', KEYS[1], 'handoffToken', 'handoffSent', 'handoffPrior')
    if (ARGV[10] or '') ~= h[1] then
      local writer = ARGV[8] or ''
      local handing = writer ~= '' and string.sub(cur[3] or '', 1, #writer) == writer and h[2] ~= '1'
      if handing and ARGV[9] == '1' then
        -- The process that handed off was lost before it said it sent its replacement: it may
        -- have died before the send, and then nothing would ever start the task id. Unless the
        -- replacement starts (is received) within ARGV[7] ms, the reaper undoes the hand-off and
        -- takes the task over (claim.lua).
        local now_arg = now_ms_text()
        local due = int_arg(tonumber(now_arg) + tonumber(ARGV[7] or '0'))
        redis.call('ZADD', KEYS[3], due, KEYS[1])
        redis.call('HSET', KEYS[1], 'leaseExpireAt', due, 'lapsedAt', now_arg, 'lapseReason', 'worker-lost')
        return {'lapsed', status}
      end
      if not (handing and kind == 'ready') then
        return {'foreign', status}
      end
      -- The process that handed off was ended by its own worker before it said it sent its
      -- replacement (a hard time limit, revoke(terminate=True)): the hand-off is undone
      -- (undo_hand_off), and the write is the owner's end, as for its running lease
      -- (stored and final; put back, REQUEUED). A replacement sent after all is then a copy.
      undo_hand_off(KEYS[1], h[3])
      redis.call('HSET', KEYS[1], 'status', 'RUNNING')
      status = 'RUNNING'
    end
  end
  if status == 'HANDED_OFF' then
    write_result(KEYS[2], meta, expires)
    if kind ~= 'ready' then
      return {'stored', status}
    end
    end_as_tombstone(KEYS[1], {'finishedAt', now_ms_text(), 'resultState', state})
    if expires > 0 then
      redis.call('PEXPIRE', KEYS[1], ARGV[5])
    end
    return 1
  end
  local writer = ARGV[8] or ''
  local owner = cur[3] or ''
  local by_owner = writer ~= '' and string.sub(owner, 1, #writer) == writer
  local live = status == 'RUNNING' or status == 'STALLED'
  if ARGV[9] == '1' then
    if by_owner and live then
      local now_arg = now_ms_text()
      redis.call('ZADD', KEYS[3], now_arg, KEYS[1])
      redis.call('HSET', KEYS[1], 'status', 'LAPSED', 'leaseExpireAt', now_arg, 'lapsedAt', now_arg,
        'lapseReason', 'worker-lost')
      return {'lapsed', status}
    end
    return {'foreign', status}
  end
  if status == 'RESERVED' and state == 'FAILURE' and not by_owner and ARGV[9] ~= '2' then
    -- A delivery that could not take the lease (a Redis that kept refusing it) fails before
    -- it ran, in a pool process (no writer) or on the host that reserved it: nobody runs it.
    -- Not a hard time limit's FAILURE whose message Celery puts back (ARGV[9] "2"): that
    -- process ran a body under a lease of its own; the reservation is a copy's.
    local host = redis.call('HGET', KEYS[1], 'reservedBy') or ''
    by_owner = writer == '' or string.sub(writer, 1, #host + 1) == host .. '/'
  end
  if not by_owner and (live or state ~= 'REVOKED') then
    return {'foreign', status}
  end
end

if status == 'DONE' or status == 'ABANDONED' or status == 'HANDED_OFF' then
  return {'finished', status}
end

if token == '' and ARGV[9] == '2' and kind == 'ready' and (status == 'RUNNING' or status == 'STALLED' or status == 'LAPSED') then
  -- The owner's process wrote its end (its body stopped, and perhaps gave the lease up:
  -- gevent's hard limit) and Celery puts the message back: it runs the task again, as a
  -- takeover (or the reaper re-sends it, if it does not come back).
  if not cur[4] then
    write_result(KEYS[2], meta, expires)
  end
  local now_arg = now_ms_text()
  local due = int_arg(tonumber(now_arg) + tonumber(ARGV[7] or '0'))
  redis.call('ZADD', KEYS[3], due, KEYS[1])
  redis.call('HSET', KEYS[1], 'status', 'REQUEUED', 'requeuedAt', now_arg, 'leaseExpireAt', due)
  return {'stored', 'REQUEUED'}
end

if cur[4] then
  -- A task id applied again after a SUCCESS: Celery keeps that SUCCESS, so nothing is
  -- written; a READY state still ends the new run's lease.
  if kind == 'ready' then
    -- The result is the earlier run's: this run's end is kept as a tombstone.
    redis.call('ZREM', KEYS[3], KEYS[1])
    end_as_tombstone(KEYS[1], {'finishedAt', now_ms_text(), 'resultState', 'SUCCESS'})
    if expires > 0 then
      redis.call('PEXPIRE', KEYS[1], ARGV[5])
    end
  end
  return {'sticky', 'kept'}
end

write_result(KEYS[2], meta, expires)
if kind == 'ready' then
  redis.call('ZREM', KEYS[3], KEYS[1])
  -- The tail the fenced backend writes for this owner (fence_of()), compared as it stands:
  -- a pattern would cost the server more than the rest of this branch.
  local tail = '/' .. (cur[5] or '') .. '", "fence_token": ' .. token .. '}'
  if token ~= '' and string.sub(meta, -#tail) == tail and string.find(meta, '"fence_run": "', -(#tail + 100), true) then
    -- The result now carries the fence, and says all the lease does (a claim that counted a
    -- takeover while this owner still held its token leaves the tombstone instead).
    redis.call('DEL', KEYS[1])
  else
    end_as_tombstone(KEYS[1], {'finishedAt', now_ms_text(), 'resultState', state})
    if expires > 0 then
      redis.call('PEXPIRE', KEYS[1], ARGV[5])
    end
  end
  return 1
elseif kind == 'retry' then
  local due = int_arg(now_ms() + tonumber(ARGV[7] or '0'))
  redis.call('ZADD', KEYS[3], due, KEYS[1])
  redis.call('HSET', KEYS[1], 'status', 'RETRYING', 'leaseExpireAt', due)
  return {'stored', 'RETRYING'}
end
return {'stored', status}
