"""The lease protocol: every change to a lease, a token or a fenced result is one Lua script
(:mod:`.scripts`), run through one gateway (:mod:`.gateway`) by one store per concern
(:mod:`.store` for leases and results, :mod:`.tokens`, :mod:`.liveness_store`,
:mod:`.metrics_store`); the lease's schema (:mod:`.fields`), its Redis keys (:mod:`.keys`), a
lease as Python reads it (:mod:`.state`) and a finished lease's fence in its result
(:mod:`.finished`). It knows nothing of Celery's worker, task or backend."""
