"""What one worker process keeps, whatever the app: :data:`WORKER_PROCESS`.

Per app, a process's worker side is its :class:`~celery_fenced._worker.runtime.WorkerRuntime`;
what belongs to the process itself (its pool, its attempt ids, the interrupt under way, the
requests its solo pool cancelled) is held here, in one object. The package's fork handler
(:mod:`.runtime`) calls :meth:`WorkerProcess.after_fork` in the child.

One thing is the whole worker's, not one process's: whether it is stopping
(:class:`SharedFlag`). Celery tells only the worker's main process that a shutdown began
(``worker_shutting_down``, sent from its signal handler); a prefork child goes on running its
body and is told nothing. The flag is a byte of memory shared across ``fork`` (an anonymous
shared mapping, made when this module is imported, before the pool forks), set by the main
process and read by every heartbeat of the worker (see
:meth:`~celery_fenced._worker.heartbeat.Heartbeat.tick`).
"""

from __future__ import annotations

import mmap
import threading
from typing import TYPE_CHECKING

from .._task.calls import AttemptIds

if TYPE_CHECKING:
    from .._task.owner import OwnedLease

__all__ = ["WORKER_PROCESS", "SharedFlag", "WorkerProcess"]


class SharedFlag:
    """A flag every process forked after it was made shares: set in one, seen in all.

    Setting and reading it takes no lock (one byte written, one read): it may be set from a
    signal handler, and read on every heartbeat wake.
    """

    def __init__(self) -> None:
        self._byte = mmap.mmap(-1, 1)  # anonymous and MAP_SHARED: a fork shares it

    def set(self) -> None:
        """Set the flag, for this process and every process forked from it."""
        self._byte[0] = 1

    def clear(self) -> None:
        """Clear the flag (a worker starts)."""
        self._byte[0] = 0

    def is_set(self) -> bool:
        """Whether the flag is set."""
        return self._byte[0] == 1


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
        stopping: set once the worker's shutdown began (the main process sets it; its prefork
            children share it): each heartbeat then publishes new details at once.
    """

    def __init__(self) -> None:
        self.pool_kind: str | None = None
        self.attempt_ids = AttemptIds()
        self.interrupting: OwnedLease | None = None
        self.interrupt_handler_installed = False
        self.cancelled_here: set[str] = set()
        self.runtimes_lock = threading.Lock()
        self.worker_id: str | None = None
        self.stopping = SharedFlag()

    def after_fork(self) -> None:
        """In a forked child: forget what was the parent's, keep what the child inherits.

        The pool kind stays (a prefork child is told "prefork" only if unset), and so do the
        worker's id, the SIGUSR1 handler and the shared ``stopping`` flag, which a fork
        inherits; the interrupt under way, the cancelled requests and the lock (a thread of
        the parent may have held it) were the parent's.
        """
        self.interrupting = None
        self.cancelled_here = set()
        self.runtimes_lock = threading.Lock()


#: This process's worker state. Global because it is the process's: one per process, whatever
#: the app (the fork handler renews what a child must not inherit).
WORKER_PROCESS = WorkerProcess()
