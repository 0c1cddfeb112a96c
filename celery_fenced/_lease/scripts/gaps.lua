-- gaps.lua: add one process's gap counts to the cluster's fine gap histograms.
--
-- A gap sample is the longest time between two progress calls of one visit of a stage: what
-- the stage's deadline bounds. Samples are counted per task and stage (each task may have
-- its own deadlines) in fine log-spaced buckets (see metrics.py, GAP_RATIO), so
-- ``celery fenced tune`` reads true quantiles of every sample, within the bucket width. Stage
-- names come from task code and may be dynamic: once the hash holds ARGV[1] fields, a field
-- not yet in it is counted under the stage "other" of its task, so the hash stays bounded.
--
-- KEYS[1]  gap histograms hash <prefix>:gaps (field "<task>|<stage>|<bucket>" -> count)
-- ARGV[1]  the most fields the hash grows to
-- ARGV[2…] pairs of "<task>|<stage>|<bucket>", count
--
-- Returns the number of fields changed.
local full = redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  local field = ARGV[i]
  if full and redis.call('HEXISTS', KEYS[1], field) == 0 then
    local task = string.match(field, '^([^|]*)|') or ''
    field = task .. '|other|' .. string.match(field, '[^|]*$')
  end
  redis.call('HINCRBY', KEYS[1], field, ARGV[i + 1])
end
return (#ARGV - 1) / 2
