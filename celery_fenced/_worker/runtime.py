"""What one worker process runs for one app: :class:`WorkerRuntime`, and the package's only
fork handler.

A runtime owns the threads and the per-process state of the worker side: the heartbeat that
serves every lease of the process, and in the worker's main process the reaper thread and
the reservation writer. It is kept in the app's weak record (:mod:`celery_fenced._celery.apps`) and
belongs to the process that made it: a forked child (a prefork pool process) starts with
none, and makes its own at its first acquire.

The fork handler, registered once when this module is imported (that is, only in a process
that runs a worker):

* before a fork, takes :data:`~celery_fenced._worker.fork_guard.FORK_GUARD`, so the fork waits
  for the unit of work a main-process thread is in (see that module);
* in the parent, releases it;
* in the child, releases it, forgets the parent's runtimes (their threads do not run in the
  child), and lets the process's state forget what was the parent's: the worker's
  (:meth:`~celery_fenced._worker.process.WorkerProcess.after_fork`: the interrupt under way,
  the locks) and the telemetry's
  (:meth:`~celery_fenced._telemetry.process.ProcessTelemetry.after_fork`: unflushed metrics).

State that a process that runs no worker also keeps (the scripts' connections, the event
dispatcher) checks its process id where it is used, and needs no handler; so do attempt ids.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from typing import Any

from celery import Celery

from .._backend.writes import set_hook
from .._celery.apps import all_records, record_of
from .._lease.liveness_store import worker_id_of
from .._telemetry.process import TELEMETRY
from ..conf import ensure_conf
from .attempt import after_write
from .fork_guard import FORK_GUARD
from .heartbeat import Heartbeat
from .listener import WorkerListener
from .liveness import LivenessRecord
from .process import WORKER_PROCESS
from .reaper_thread import ReaperThread
from .reservations import ReservationWriter

__all__ = ["WorkerRuntime", "reservation_writer_of", "runtime_of", "runtimes", "stop_runtimes"]

logger = logging.getLogger("celery_fenced.worker.runtime")


class WorkerRuntime:
    """The worker side of one app in one process.

    Attributes:
        app: the app.
        pid: the process it belongs to.
        reaper: the main process's reaper thread, once started.
        reservations: the main process's reservation writer, once started.
        liveness: the main process's liveness record, once started.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.pid = os.getpid()
        self.reaper: ReaperThread | None = None
        self.reservations: ReservationWriter | None = None
        self.liveness: LivenessRecord | None = None
        self._heartbeat: Heartbeat | None = None
        self._lock = threading.Lock()

    def heartbeat(self, create: bool = True) -> Heartbeat | None:
        """The process's heartbeat for the app (made at the first lease)."""
        heartbeat = self._heartbeat
        if heartbeat is None and create:
            with self._lock:
                if self._heartbeat is None:
                    app = self.app
                    self._heartbeat = Heartbeat(
                        store_factory=lambda: app.backend.lease_store,
                        listener=WorkerListener(app),
                        default_interval=ensure_conf(app).policy.heartbeat_interval,
                    )
                heartbeat = self._heartbeat
        return heartbeat

    def start_main_process_threads(self, hostname: str, hub: Any = None, worker_id: str | None = None) -> None:
        """The worker's main process: start its liveness record (under ``worker_id``, this
        start's; one is made if not given), the reaper thread and the reservation writer."""
        worker_id = worker_id or worker_id_of(hostname, os.getpid(), secrets.token_hex(4))
        self.liveness = LivenessRecord(self.app, worker_id)
        self.liveness.start()
        self.reaper = ReaperThread(self.app)
        self.reaper.start()
        self.reservations = ReservationWriter(
            self.app, hostname, on_dropped=self.reaper.wake, hub=hub, worker_id=worker_id
        )
        self.reservations.start()

    def stop(self, heartbeat: bool = True) -> None:
        """Stop the reservation writer and the reaper thread, and (unless ``heartbeat`` is
        false: the pool may still run bodies) the liveness record and the heartbeat; join them.

        The liveness record goes with the heartbeat, once the pool has stopped: while a body
        may still run, a hand-off it makes is filed under the record, which must lapse, not
        be removed, should the worker die before the send (``lapse_worker.lua``).
        """
        if self.reservations is not None:
            self.reservations.stop()
        if self.reaper is not None:
            self.reaper.stop()
        if heartbeat and self.liveness is not None:
            self.liveness.stop()
        if heartbeat and self._heartbeat is not None:
            self._heartbeat.stop()


def runtime_of(app: Celery, create: bool = True) -> WorkerRuntime | None:
    """This process's runtime of ``app`` (made on first use, with the worker's write hook)."""
    record = record_of(app)
    runtime: WorkerRuntime | None = record.runtime
    if runtime is not None and runtime.pid == os.getpid():
        return runtime
    if not create:
        return None
    with WORKER_PROCESS.runtimes_lock:
        runtime = record.runtime
        if runtime is None or runtime.pid != os.getpid():
            runtime = record.runtime = WorkerRuntime(app)
            set_hook(app, after_write)
    return runtime


def reservation_writer_of(app: Celery) -> ReservationWriter | None:
    """The reservation writer of this worker's main process for ``app``, once started."""
    runtime = runtime_of(app, create=False)
    return runtime.reservations if runtime is not None else None


def runtimes() -> list[WorkerRuntime]:
    """The runtimes of this process, one per app that has one."""
    pid = os.getpid()
    return [record.runtime for record in all_records() if record.runtime is not None and record.runtime.pid == pid]


def stop_runtimes(heartbeat: bool = True) -> None:
    """Stop every runtime of this process (its worker shuts down); ``heartbeat``: its
    heartbeat too."""
    for runtime in runtimes():
        runtime.stop(heartbeat=heartbeat)


def _after_fork_in_parent() -> None:
    FORK_GUARD.release()


def _after_fork_in_child() -> None:
    FORK_GUARD.release()
    WORKER_PROCESS.after_fork()
    TELEMETRY.after_fork()
    for record in all_records():
        record.runtime = None


os.register_at_fork(
    before=FORK_GUARD.acquire, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
