-- metrics.lua: add one process's metric deltas to the cluster-wide totals.
--
-- Every worker process counts in memory and flushes here (with its heartbeat, or right
-- after a rare event), so the totals are aggregated over every process on every machine.
--
-- KEYS[1]  metrics hash <prefix>:metrics
-- ARGV     pairs of field, delta (fields: "<metric>|<labels>" counters, and histogram
--          "<metric>|<labels>|bucket|<le>", "<metric>|<labels>|sum", "<metric>|<labels>|count")
--
-- Returns the number of fields changed.
for i = 1, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
return #ARGV / 2
