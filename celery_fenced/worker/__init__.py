"""The worker side of a fenced task, in the order of an attempt's life.

* :mod:`~celery_fenced.worker.hooks`: Celery's signals and bootsteps call in here; the
  worker is checked at start and runs the reaper thread.
* :mod:`~celery_fenced.worker.reservations`: reserve each fenced task the worker receives,
  so a message dropped before it starts is sent again.
* :mod:`~celery_fenced.worker.attempt`: :class:`~celery_fenced.worker.attempt.Attempt`,
  what the worker knows of one running delivery (its lease, why it is skipped, how it ends).
* :mod:`~celery_fenced.worker.lifecycle`: take the lease before the body, serve it with the
  process's heartbeat, end it after the result write.
* :mod:`~celery_fenced.worker.listener`: what the heartbeat's findings do (events, signals,
  reaps, the ``fenced_max_task_duration`` FAILURE).
* :mod:`~celery_fenced.worker.interrupt`: stop a body whose lease is lost.
* :mod:`~celery_fenced.worker.reaper_thread`: takeovers from the worker's main process.
* :mod:`~celery_fenced.worker.request`: the request class whose main-process writes name
  the owner's process.
* :mod:`~celery_fenced.worker.runtime`: what one worker process runs for one app (the
  heartbeat, the reaper thread, the reservation writer), and the package's only fork handler.

Nothing outside this package imports it: :mod:`celery_fenced.wiring` loads it when a fenced
task runs in a worker, and Celery loads its bootsteps by name when a worker starts.
"""
