-- metrics.lua: add one process's metric deltas to the cluster-wide totals.
--
-- Every worker process counts in memory and flushes here (with its heartbeat, or right
-- after a rare event), so the totals are aggregated over every process on every machine.
--
-- Stage names come from task code and may be dynamic: once the hash holds ARGV[1] fields, a
-- field not yet in it is counted under the stage "other", so the hash stays bounded.
--
-- KEYS[1]  metrics hash <prefix>:metrics
-- ARGV[1]  the most fields the hash grows to (new stage series beyond it fold into "other")
-- ARGV[2…] pairs of field, delta (fields: "<metric>|<labels>" counters, and histogram
--          "<metric>|<labels>|bucket|<le>", "<metric>|<labels>|sum", "<metric>|<labels>|count")
--
-- Returns the number of fields changed.
local full = redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  local field = ARGV[i]
  if full and string.find(field, 'stage=', 1, true) and redis.call('HEXISTS', KEYS[1], field) == 0 then
    field = string.gsub(field, 'stage=[^,|]*', 'stage=other')
  end
  redis.call('HINCRBYFLOAT', KEYS[1], field, ARGV[i + 1])
end
return (#ARGV - 1) / 2
