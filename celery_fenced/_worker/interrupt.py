"""Stop the body of an attempt whose lease is lost: :func:`interrupt`, and what holds it off.

The interrupt is :class:`~celery_fenced.exceptions.LeaseInterrupted`, a ``BaseException``:
a body's ``except Exception`` around the call it is stuck in cannot swallow it. It is
delivered two ways, by the pool that runs this process:

* prefork children get SIGUSR1, whose handler raises it in the task thread even out of a
  blocking sleep or socket read (billiard's own SIGUSR1 handler, a soft time limit, keeps
  every SIGUSR1 not sent here);
* threads and solo pools get an asynchronous exception in the task's thread, raised when
  that thread next runs Python code (SIGUSR1 would make the main process dump tracebacks);
* the gevent pool throws it into the task's greenlet from the hub, at the wait the greenlet
  is blocked in (a socket read with no timeout included): see :mod:`.greenlets`.

Whether to deliver is the lease's interrupter's to decide, under its lock
(:meth:`~celery_fenced._task.interrupter.Interrupter.interrupt`): a body that finished is left alone, a
shielded one gets the interrupt when its shield ends, and an asynchronous exception sent but
not yet raised is withdrawn when the body ends or enters a shield, so it never lands in
Celery's code after the body, nor inside a shielded block.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

from .._task.interrupter import Interrupter
from .._task.owner import OwnedLease
from .._task.running import thread_state
from ..exceptions import LeaseInterrupted
from . import greenlets
from .process import WORKER_PROCESS

__all__ = [
    "body_runner",
    "end_of_body",
    "install_interrupt_handler",
    "interrupt",
    "pool_kind",
    "set_pool_kind",
    "shielded",
]

logger = logging.getLogger("celery_fenced.worker.interrupt")


def set_pool_kind(kind: str, *, only_if_unset: bool = False) -> None:
    """Record which pool runs this process's tasks (it decides how a body is interrupted)."""
    if only_if_unset and WORKER_PROCESS.pool_kind is not None:
        return
    WORKER_PROCESS.pool_kind = kind


def pool_kind() -> str | None:
    """The pool recorded for this process (``None`` outside a worker)."""
    return WORKER_PROCESS.pool_kind


def body_runner() -> Any:
    """What runs the body calling this, for :func:`interrupt`: its greenlet on the gevent pool,
    else ``None`` (its thread is the lease's ``thread_id``)."""
    return greenlets.current() if WORKER_PROCESS.pool_kind == "gevent" else None


class _AsyncLeaseInterrupted(LeaseInterrupted):
    """The interrupt as an asynchronous exception: raised as a class, built with no arguments
    in the thread it interrupts, so it takes the task id, token and reason from that thread's
    lease."""

    def __init__(self, *args: Any) -> None:
        lease = thread_state.lease if not args else None
        if lease is not None:
            args = (lease.task_id, lease.token, lease.lost_reason or "lease lost")
        super().__init__(*args)


def _interrupted(lease: OwnedLease) -> LeaseInterrupted:
    return LeaseInterrupted(lease.task_id, lease.token, lease.lost_reason or "lease lost")


def install_interrupt_handler() -> None:
    """Prefork child, main thread: let SIGUSR1 raise the interrupt that :func:`interrupt` sent.

    Installed at the first acquire, after billiard installed its own handler (idempotent).
    """
    process = WORKER_PROCESS
    if (
        process.interrupt_handler_installed
        or process.pool_kind != "prefork"
        or threading.current_thread() is not threading.main_thread()
    ):
        return
    process.interrupt_handler_installed = True
    previous = signal.getsignal(signal.SIGUSR1)

    def on_sigusr1(signum: int, frame: Any) -> Any:
        lease, process.interrupting = process.interrupting, None
        if lease is None:
            if callable(previous):
                return previous(signum, frame)
            return None
        if lease.interrupter.signal_landed():
            raise _interrupted(lease)
        return None

    signal.signal(signal.SIGUSR1, on_sigusr1)


def _set_async_exc(thread_id: int, exc: Any) -> int:
    modified: int = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)
    return modified


def _withdraw(interrupter: Interrupter) -> None:
    """Withdraw an asynchronous interrupt sent to the body's thread and not yet raised.

    A greenlet's needs nothing here: it asks the interrupter when it lands (``sent``, which
    the caller has just cleared)."""
    if interrupter.runner is None:
        _set_async_exc(interrupter.thread_id, None)


def _deliver(lease: OwnedLease) -> bool:
    """Send the interrupt (the interrupter's lock is held); True for an asynchronous exception."""
    target = lease.interrupter
    if WORKER_PROCESS.pool_kind == "prefork" and target.thread_id == threading.main_thread().ident:
        logger.warning("interrupting task %s[%s] (SIGUSR1)", lease.task_name, lease.task_id)
        WORKER_PROCESS.interrupting = lease
        os.kill(os.getpid(), signal.SIGUSR1)
        return False
    if target.runner is not None:
        logger.warning("interrupting task %s[%s] (thrown into its greenlet)", lease.task_name, lease.task_id)
        return greenlets.throw_later(lease, target.runner, _interrupted(lease))
    logger.warning("interrupting task %s[%s] (async exception)", lease.task_name, lease.task_id)
    modified = _set_async_exc(target.thread_id, ctypes.py_object(_AsyncLeaseInterrupted))
    if modified == 1:
        return True
    if modified == 0:
        logger.warning("task %s[%s]: its thread is gone, nothing to interrupt", lease.task_name, lease.task_id)
    else:  # CPython's documented rule: more than one thread state changed, undo them all
        _set_async_exc(target.thread_id, None)
        logger.error(
            "task %s[%s]: the interrupt matched %d threads; withdrawn", lease.task_name, lease.task_id, modified
        )
    return False


def interrupt(lease: OwnedLease) -> None:
    """Stop the body of a lease that was lost, unless it finished; wait for a shielded block."""
    if lease.interrupter.interrupt(partial(_deliver, lease)) == "held":
        logger.warning("task %s[%s] is shielded: interrupted when the block ends", lease.task_name, lease.task_id)


def end_of_body(lease: OwnedLease) -> None:
    """The body returned or raised: no interrupt may land from now on (its thread calls this)."""
    lease.interrupter.finish_body(_withdraw)


@contextlib.contextmanager
def shielded(lease: OwnedLease) -> Iterator[None]:
    """Hold off the interrupt while the block runs; raise it at the end of the outermost block.

    The lease may still be lost meanwhile: ``progress()`` inside raises ``LeaseLostError``
    as anywhere, and the result of a lost owner is still refused.
    """
    lease.interrupter.enter_shield(_withdraw)
    try:
        yield
    finally:
        if lease.interrupter.leave_shield():
            raise _interrupted(lease)
