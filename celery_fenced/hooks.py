"""What the heartbeat's findings do in a worker: events, signals, reaps, interrupts, failures.

:class:`WorkerHooks` is the :class:`~celery_fenced.heartbeat.HeartbeatHooks` of a worker
process: a lost lease is reported (``task-lease-lost``, ``lease_lost``) and, where
configured, its body interrupted; a stall is reported; a released lease asks for a reap; an
attempt past ``fenced_max_task_duration`` gets its FAILURE stored; a new stage is published
to Flower.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import threading
from collections.abc import Mapping
from typing import Any

from celery import Celery
from celery import states as celery_states
from celery.app.task import Context
from celery.exceptions import TimeLimitExceeded

from . import events
from . import signals as fenced_signals
from .conf import nearest
from .exceptions import LeaseLostError
from .owner import OwnedLease, thread_state
from .reaper import request_reap

__all__ = ["WorkerHooks", "install_interrupt_handler", "interrupt", "send_lease_event", "set_pool_kind"]

logger = logging.getLogger("celery_fenced.hooks")

# The pool of this process: "prefork" in a prefork child, else what the worker's bootstep
# saw ("threads", "solo", ...). None outside a worker.
_pool_kind: str | None = None


def set_pool_kind(kind: str, *, only_if_unset: bool = False) -> None:
    """Record which pool runs this process's tasks (it decides how a body is interrupted)."""
    global _pool_kind
    if only_if_unset and _pool_kind is not None:
        return
    _pool_kind = kind


class WorkerHooks:
    """What the heartbeat's findings do in a worker: signals, interrupts, reaps, failures."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def lost(self, lease: OwnedLease, reason: str) -> None:
        send_lease_event(self.app, "task-lease-lost", lease, reason=reason)
        self._tell_the_body(lease, reason)

    @staticmethod
    def _tell_the_body(lease: OwnedLease, reason: str) -> None:
        """The ``lease_lost`` signal, then the interrupt where the task asks for one."""
        fenced_signals.lease_lost.send(
            sender=lease.task_name, task_id=lease.task_id, token=lease.token, stage=lease.stage, reason=reason
        )
        if lease.policy.interrupt_on_loss:
            interrupt(lease)

    def stalled(self, lease: OwnedLease, bound: str, allowed: float, elapsed: float) -> None:
        send_lease_event(
            self.app,
            "task-stalled",
            lease,
            bound=bound,
            allowed=allowed,
            elapsed=round(elapsed, 3),
            on_stall=lease.policy.on_stall,
        )
        fenced_signals.progress_stalled.send(
            sender=lease.task_name,
            task_id=lease.task_id,
            token=lease.token,
            stage=lease.stage,
            bound=bound,
            allowed=allowed,
            elapsed=elapsed,
            on_stall=lease.policy.on_stall,
        )

    def released(self, lease: OwnedLease) -> None:
        request_reap(self.app)

    def duration_exceeded(self, lease: OwnedLease) -> None:
        limit = lease.policy.max_task_duration
        reason = f"max task duration exceeded ({limit:g}s)"
        if not lease.mark_lost(reason):
            return
        logger.error(
            "task %s[%s] ran past fenced_max_task_duration (%ss): FAILURE stored, token=%s",
            lease.task_name,
            lease.task_id,
            limit,
            lease.token,
        )
        request = Context(id=lease.task_id, task=lease.task_name, fenced_lease=lease, hostname=socket.gethostname())
        failure = TimeLimitExceeded(f"fenced_max_task_duration ({limit:g}s) exceeded")
        try:
            self.app.backend.store_result(lease.task_id, failure, celery_states.FAILURE, request=request)
        except Exception:
            logger.exception("could not store the max-duration FAILURE of task %s", lease.task_id)
        if getattr(request, "fenced_write", None) == "stored":
            # The attempt now ends as an Ignore, for which the worker sends no event: without
            # this one, Flower would show the task running for good.
            send_lease_event(self.app, "task-failed", lease, exception=repr(failure), traceback="")
            backend = self.app.backend
            state = backend.lease_store.read(lease.task_id)
            backend.ended_without_owner(lease.task_id, state.call if state else None, failure, celery_states.FAILURE)
        self._tell_the_body(lease, reason)

    def renewed(self, leases: list[OwnedLease]) -> None:
        for lease in leases:
            if lease.stage == lease.published_stage:
                continue
            lease.published_stage = lease.stage
            send_lease_event(self.app, "task-progress", lease, version=lease.version, takeovers=lease.takeovers)
            table = lease.policy.stage_timeouts
            if table and lease.stage is not None and lease.stage not in table:
                _log_unknown_stage_once(lease.task_name, lease.stage, table, lease.policy.default_stage_timeout)


_unknown_stages: set[str] = set()


def _log_unknown_stage_once(task_name: str, stage: str, table: Mapping[str, float], default: float) -> None:
    """Warn once per stage and process about a stage the table does not have (a typo, often)."""
    if stage in _unknown_stages:
        return
    _unknown_stages.add(stage)
    hint = nearest(stage, table)
    logger.warning(
        "task %s: stage %r is not in fenced_stage_timeouts%s; it gets the default deadline (%gs)",
        task_name,
        stage,
        f" (did you mean {hint!r}?)" if hint else "",
        default,
    )


def send_lease_event(app: Celery, event_type: str, lease: OwnedLease, **fields: Any) -> None:
    """Send a task event about ``lease`` (its id, token, stage, attempt and name) plus ``fields``.

    Nothing is built when events are off: an attempt's first event is on every task's path.
    """
    if not events.enabled(app):
        return
    events.send(
        app,
        event_type,
        task_id=lease.task_id,
        token=lease.token,
        stage=lease.stage,
        attempt=lease.attempt,
        name=lease.task_name,
        **fields,
    )


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
