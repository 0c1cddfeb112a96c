"""Stop the body of an attempt whose lease is lost.

Prefork children get SIGUSR1, which raises :class:`~celery_fenced.exceptions.LeaseLostError`
in the task thread even out of a blocking call; threads and solo pools get an asynchronous
exception in the task's thread. Which one applies depends on the pool running this process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from typing import Any

from ..exceptions import LeaseLostError
from ..owner import OwnedLease, thread_state

__all__ = ["install_interrupt_handler", "interrupt", "set_pool_kind"]

logger = logging.getLogger(__name__)

# The pool of this process: "prefork" in a prefork child, else what the worker's bootstep
# saw ("threads", "solo", ...). None outside a worker.
_pool_kind: str | None = None


def set_pool_kind(kind: str, *, only_if_unset: bool = False) -> None:
    """Record which pool runs this process's tasks (it decides how a body is interrupted)."""
    global _pool_kind
    if only_if_unset and _pool_kind is not None:
        return
    _pool_kind = kind


class _LeaseLostInterrupt(LeaseLostError):
    """The ``LeaseLostError`` raised asynchronously in a task's thread (threads and solo pools).

    An asynchronous exception is raised as a class and built with no arguments in the
    thread it interrupts: it takes the task id, token and reason from that thread's lease.
    """

    def __init__(self, *args: Any) -> None:
        lease = thread_state.lease if not args else None
        if lease is not None:
            args = (lease.task_id, lease.token, lease.lost_reason or "lease lost")
        super().__init__(*args)


# The lease whose body the SIGUSR1 under way interrupts (prefork children only).
_interrupting: OwnedLease | None = None
_handler_installed = False


def install_interrupt_handler() -> None:
    """Prefork child, main thread: let SIGUSR1 raise ``LeaseLostError`` for an interrupt.

    Billiard's own SIGUSR1 handler (a soft time limit) is kept for every other SIGUSR1: the
    new handler raises ``LeaseLostError`` only when :func:`interrupt` sent the signal. It is
    installed at the first acquire, after billiard installed its own (idempotent).
    """
    global _handler_installed
    if _handler_installed or _pool_kind != "prefork" or threading.current_thread() is not threading.main_thread():
        return
    _handler_installed = True
    previous = signal.getsignal(signal.SIGUSR1)

    def on_sigusr1(signum: int, frame: Any) -> Any:
        global _interrupting
        lease, _interrupting = _interrupting, None
        if lease is not None:  # ours: a body that finished meanwhile is left alone
            if not lease.body_done:
                raise LeaseLostError(lease.task_id, lease.token, lease.lost_reason or "lease lost")
            return None
        if callable(previous):
            return previous(signum, frame)
        return None

    signal.signal(signal.SIGUSR1, on_sigusr1)


def interrupt(lease: OwnedLease) -> None:
    """Stop the body of a lease that was lost, unless it already finished.

    Prefork: SIGUSR1 to this child raises ``LeaseLostError`` in the task thread, even out of
    a blocking sleep or socket read (see :func:`install_interrupt_handler`). Threads and
    solo: an asynchronous ``LeaseLostError`` in the task's thread, raised when that thread
    next runs Python code (SIGUSR1 would make the main process dump tracebacks there).
    """
    global _interrupting
    with lease.lock:
        if lease.body_done:
            return
        if _pool_kind == "prefork" and lease.thread_id == threading.main_thread().ident:
            logger.warning("interrupting task %s[%s] (SIGUSR1)", lease.task_name, lease.task_id)
            _interrupting = lease
            os.kill(os.getpid(), signal.SIGUSR1)
            return
        logger.warning("interrupting task %s[%s] (async exception)", lease.task_name, lease.task_id)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(lease.thread_id), ctypes.py_object(_LeaseLostInterrupt)
        )
