"""What one worker process keeps, whatever the app: :data:`WORKER_PROCESS`.

Per app, a process's worker side is its :class:`~celery_fenced._worker.runtime.WorkerRuntime`;
what belongs to the process itself (its pool, its attempt ids, the interrupt under way, the
requests its solo pool cancelled) is held here, in one object. The package's fork handler
(:mod:`.runtime`) calls :meth:`WorkerProcess.after_fork` in the child.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .._task.calls import AttemptIds

if TYPE_CHECKING:
    from .._task.owner import OwnedLease

__all__ = ["WORKER_PROCESS", "WorkerProcess"]


class WorkerProcess:
    """The worker state of one process.

    Attributes:
        pool_kind: the pool that runs this process's tasks: "prefork" in a prefork child, else
            what the worker's bootstep saw ("threads", "solo", "gevent"); ``None`` outside a
            worker. It decides how a body is interrupted (:mod:`.interrupt`).
        attempt_ids: the ids of this process's attempts (they redraw themselves in a fork).
        interrupting: the lease whose body the SIGUSR1 under way interrupts (prefork children).
        interrupt_handler_installed: whether this process's SIGUSR1 handler is the interrupt's.
        cancelled_here: ids of the requests Celery cancelled whose bodies run in the thread
            that handled the cancel (the solo pool).
        runtimes_lock: held while an app's :class:`~.runtime.WorkerRuntime` is made.
        worker_id: the id of this start of the worker (``<hostname>/<pid>/<start>``, its
            liveness record's), set in the main process before the pool forks, so a prefork
            child files its hand-offs under it; ``None`` outside a worker.
    """

    def __init__(self) -> None:
        self.pool_kind: str | None = None
        self.attempt_ids = AttemptIds()
        self.interrupting: OwnedLease | None = None
        self.interrupt_handler_installed = False
        self.cancelled_here: set[str] = set()
        self.runtimes_lock = threading.Lock()
        self.worker_id: str | None = None

    def after_fork(self) -> None:
        """In a forked child: forget what was the parent's, keep what the child inherits.

        The pool kind stays (a prefork child is told "prefork" only if unset), and so do the
        worker's id and the SIGUSR1 handler, which a fork inherits; the interrupt under way, the cancelled
        requests and the lock (a thread of the parent may have held it) were the parent's.
        """
        self.interrupting = None
        self.cancelled_here = set()
        self.runtimes_lock = threading.Lock()


#: This process's worker state. Global because it is the process's: one per process, whatever
#: the app (the fork handler renews what a child must not inherit).
WORKER_PROCESS = WorkerProcess()
