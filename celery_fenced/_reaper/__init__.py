"""The reaper: ``celery_fenced.reap`` on beat's schedule (or a worker's reaper thread) claims
the leases whose owners stopped renewing, sends their tasks again or ends them (:mod:`.reaper`)."""
