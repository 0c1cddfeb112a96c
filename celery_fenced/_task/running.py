"""What rides along while a fenced attempt runs, as the task class sees it.

Each question has one place to ask:

* *Did the worker begin an attempt for this request?* The request: the worker side
  (:mod:`celery_fenced._worker.attempt`) puts its attempt there at ``task_prerun``; the task
  class only asks whether one began (:func:`began`), and hands the call to the worker side.
  What the result backend needs of it rides on the request too, as plain data
  (:class:`~celery_fenced._backend.fence.WriterFence`).
* *Which lease does the body running in this thread hold?* The thread: :func:`current_lease`
  (a thread-local read, on ``progress()``'s hot path), set at acquire and cleared at the
  attempt's ``task_postrun``: the body's API keeps its lease after a hand-off or a ``retry()``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .owner import OwnedLease

__all__ = ["ATTEMPT_ATTRIBUTE", "began", "current_lease", "set_current_lease", "thread_state"]

#: The request attribute the worker's attempt rides on.
ATTEMPT_ATTRIBUTE = "fenced_attempt"


def began(request: Any) -> bool:
    """True when the worker began an attempt for ``request``; False for eager calls, writes
    from the worker's main process, and processes that run no worker."""
    return getattr(request, ATTEMPT_ATTRIBUTE, None) is not None


class _ThreadState(threading.local):
    lease: OwnedLease | None = None


# Global: the lease of the attempt whose body this thread (a greenlet, on the gevent pool) runs,
# read by every progress() call (a thread-local read).
thread_state = _ThreadState()


def current_lease() -> OwnedLease | None:
    """The lease of the attempt this thread is running, if any (a thread-local read)."""
    return thread_state.lease


def set_current_lease(lease: OwnedLease | None) -> None:
    """Make ``lease`` this thread's running attempt (``None`` when it ends)."""
    thread_state.lease = lease
