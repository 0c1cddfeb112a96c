"""The worker side of a fenced task, in the order of an attempt's life.

* :mod:`~celery_fenced._worker.hooks`: Celery's signals and bootsteps call in here; the
  worker runs the reaper thread.
* :mod:`~celery_fenced._worker.checks`: what the worker is checked for at start (its pool,
  its backend, its tasks' settings, the lease Redis user's commands).
* :mod:`~celery_fenced._worker.reservations`: reserve each fenced task the worker receives,
  so a message dropped before it starts is sent again.
* :mod:`~celery_fenced._worker.attempt`: :class:`~celery_fenced._worker.attempt.Attempt`,
  what the worker knows of one running delivery (its lease, why it is skipped, how it ends).
* :mod:`~celery_fenced._worker.lifecycle`: take the lease before the body, serve it with the
  process's heartbeat, end it after the result write.
* :mod:`~celery_fenced._worker.listener`: what the heartbeat's findings do (events, signals,
  reaps, the ``fenced_max_task_duration`` FAILURE).
* :mod:`~celery_fenced._worker.heartbeat`: one thread per process renews its owners' leases
  while they make progress (on :mod:`~celery_fenced._worker.loop`, the package's thread loop).
* :mod:`~celery_fenced._worker.interrupt`: stop a body whose lease is lost.
* :mod:`~celery_fenced._worker.reaper_thread`: takeovers from the worker's main process.
* :mod:`~celery_fenced._worker.request`: the request class whose main-process writes name
  the owner's process.
* :mod:`~celery_fenced._worker.runtime`: what one worker process runs for one app (the
  heartbeat, the reaper thread, the reservation writer), and the package's only fork handler.
* :mod:`~celery_fenced._worker.process`: what one worker process keeps whatever the app (its
  pool, its attempt ids, the interrupt under way, the requests its solo pool cancelled).

Nothing outside this package imports it but the task class, for an attempt that runs:
:mod:`celery_fenced._task.wiring` loads it when a fenced task runs in a worker, and Celery
loads its bootsteps by name when a worker starts.
"""
