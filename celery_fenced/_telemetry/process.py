"""What this process's telemetry keeps, whatever the app: :data:`TELEMETRY`.

Every process that runs fenced code counts metrics (a worker's owners and heartbeat, the
reaper wherever it runs, a refused fenced write in a web process) and may send events, so
this state is not the worker's: it lives here, below every writer, in one object. A worker's
fork handler (:mod:`celery_fenced._worker.runtime`) calls :meth:`ProcessTelemetry.after_fork`
in the child; a process that runs no worker registers no fork handler and keeps its own.
"""

from __future__ import annotations

import threading

from .metrics import MetricsBuffer

__all__ = ["TELEMETRY", "ProcessTelemetry"]


class ProcessTelemetry:
    """The telemetry state of one process.

    Attributes:
        metrics: the metric deltas waiting for the next flush (the only buffer the package
            writes; every writer reaches it here).
        events_enabled: whether task events are on, as the worker's bootstep saw them
            (``None``: read ``worker_send_task_events`` from the app).
        events_hostname: the name events are sent under (``None``: ``celery@<host>``).
        events_lock: held while an app's event dispatcher is made, used or dropped.
    """

    def __init__(self) -> None:
        self.metrics = MetricsBuffer()
        self.events_enabled: bool | None = None
        self.events_hostname: str | None = None
        self.events_lock = threading.Lock()

    def after_fork(self) -> None:
        """In a forked child: forget the parent's unflushed metrics (the parent flushes them)
        and its locks (a thread of the parent may have held one); keep the event settings."""
        self.metrics = MetricsBuffer()
        self.events_lock = threading.Lock()


#: This process's telemetry. Global because it is the process's: one per process whatever the
#: app, reached from every layer that counts or sends (a worker's fork handler renews it).
TELEMETRY = ProcessTelemetry()
