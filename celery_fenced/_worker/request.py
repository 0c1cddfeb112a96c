"""The worker's request class for fenced tasks: main-process writes name the owner's process.

Celery writes some results from the worker's main process, without a token: a hard time
limit, a ``WorkerLostError`` after a prefork child died, ``Reject``, a revoke. They come with
a context rebuilt from the message, which does not say which process ran the task. This
request adds ``worker_pid`` to that context, so the fenced store matches such a write to
the lease's owner *process* (not only its host), and tells a copy that never started (no
pid) from the owner.

On the gevent pool Celery's ``worker_pid`` is the id of the task's greenlet; the greenlets
run in the worker's own process, so the context names that process's pid, as the owner id does.

A request Celery cancels (a cold shutdown, a lost broker connection with
``worker_cancel_long_running_tasks_on_connection_loss``) stops a body that never finished:
its context says so, and the fenced store takes the RETRY Celery writes for it as the end of
the owner's process (the lease lapses for a takeover, nothing is stored), never as a retry.

A process lost between accepting a task and taking its lease leaves no lease to lapse: before
Celery writes that ``WorkerLostError``, the request makes the task's reservation due, so the
reaper sends it again and the fenced store refuses the failure, as it does for an owner lost
while it held the lease.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .._backend.backend import CANCELLED, PUT_BACK
from .._celery.compat import ContextHookRequest, acks_on_timeout, is_process_lost, request_context
from ..conf import ensure_conf
from .interrupt import pool_kind
from .process import WORKER_PROCESS
from .runtime import reservation_writer_of

__all__ = ["FencedRequest", "cancelled_here"]

logger = logging.getLogger("celery_fenced.worker.request")


def cancelled_here(task_id: str) -> bool:
    """Whether Celery cancelled the request of ``task_id``, whose body runs in the thread that
    handled the cancel (solo): what the body raises next is the cancel's, not its own end."""
    return task_id in WORKER_PROCESS.cancelled_here


class FencedRequest(ContextHookRequest):
    """Celery's worker request; its context also carries the pid of the process running it,
    and every way it ends (a process accepting it, a revoke or expiry before that, a reject)
    ends the worker's hold on its reservation."""

    def on_accepted(self, pid: Any, time_accepted: float) -> None:
        """Celery's handler of a process accepting the task; the reservation is no longer held."""
        super().on_accepted(pid, time_accepted)
        writer = reservation_writer_of(self.task.app)
        if writer is not None:
            writer.started(self.id)

    def revoked(self) -> bool:
        """Celery's check, before the request goes to the pool, that it was not revoked and has
        not expired; one that was ends here, unstarted: its reservation is no longer held."""
        if not super().revoked():
            return False
        writer = reservation_writer_of(self.task.app)
        if writer is not None:
            writer.ended(self.id)
        return True

    def reject(self, requeue: bool = False) -> None:
        """Celery rejects the message (perhaps before any process started it: an eta it cannot
        read); the reservation is no longer held."""
        super().reject(requeue=requeue)
        writer = reservation_writer_of(self.task.app)
        if writer is not None:
            writer.ended(self.id)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        """Celery's failure handler; a lost process's task first gets a reservation due now."""
        if is_process_lost(self, exc_info.exception):
            writer = reservation_writer_of(self.task.app)
            if writer is not None:
                writer.lost(self)
            if self._sent_again_when_lost():
                self._lapse_lost_owner()
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _sent_again_when_lost(self) -> bool:
        """Whether Celery sends the message of a lost process again before (or instead of) the
        tokenless write that moves the lease: ``task_acks_late`` with
        ``task_reject_on_worker_lost`` puts it back and writes nothing, and Celery 5.7's
        ``retry_on_worker_lost`` sends the retry first and stores RETRY after it. Either
        message, received at once by another worker, would find the dead process's lease live
        and be dropped as a duplicate. (Past ``max_retries`` Celery writes the
        ``WorkerLostError``, which lapses the lease as this does.)"""
        task = self.task
        if getattr(task, "retry_on_worker_lost", False):
            return True
        return bool(task.acks_late and task.reject_on_worker_lost)

    def _retry_due_ms(self) -> int | None:
        """Where Celery 5.7 retries the lost process's task: ms until that retry is overdue
        (its ``default_retry_delay`` and the requeue timeout, as the RETRY Celery then writes
        sets). ``None`` where it does not retry (no ``retry_on_worker_lost``, or
        ``max_retries`` reached: it writes the ``WorkerLostError``)."""
        task = self.task
        if not getattr(task, "retry_on_worker_lost", False):
            return None
        max_retries = task.max_retries
        if max_retries is not None and (request_context(self).retries or 0) >= max_retries:
            return None
        try:
            delay = max(0.0, float(task.default_retry_delay or 0))
        except (TypeError, ValueError):
            delay = 0.0
        return int((delay + ensure_conf(task.app).requeue_timeout) * 1000)

    def _lapse_lost_owner(self) -> None:
        """The lost process owned the lease: give it up now, as the ``WorkerLostError`` write
        would have, so the message put back (or the reaper's re-send) takes the task over at
        once instead of being dropped as a duplicate of a dead owner until the TTL runs out.

        A retry Celery sends instead finds the lease ``RETRYING``, due only once that retry is
        overdue: a lease lapsed now would be due at once, and a reaper pass before Celery's
        RETRY write would send the original call (``retries`` 0) as a takeover."""
        pid = self.worker_pid
        if pid is None or not self.hostname:
            return
        try:
            outcome = self.task.backend.lease_store.lapse_now(
                self.id, owner_prefix=f"{self.hostname}/{pid}/", retry_due_ms=self._retry_due_ms()
            )
        except Exception as exc:
            logger.warning(
                "task %s[%s]: its process was lost and its lease could not be given up (%r)", self.name, self.id, exc
            )
            return
        if outcome == "lapsed":
            logger.warning("task %s[%s]: its process was lost: lease given up for a takeover", self.name, self.id)
        elif outcome == "retrying":
            logger.warning("task %s[%s]: its process was lost: lease kept for Celery's retry", self.name, self.id)

    def cancel(self, pool: Any, *args: Any, **kwargs: Any) -> Any:
        """Celery cancels the running request (its body never finishes): its writes say so.

        Where the body runs in the thread that handles the signal (solo), it is told too: a
        solo pool cannot terminate it, and Celery's cold shutdown then raises that
        ``NotImplementedError`` into the body, from its signal handler. On threads (and on
        gevent, whose kill is a ``GreenletExit``) nothing of the cancel is raised into the
        body: an error the body raises is its own end.
        """
        self.__dict__[CANCELLED] = True
        if pool_kind() == "solo":
            WORKER_PROCESS.cancelled_here.add(self.id)
        # Celery's own arguments, as its version takes them (5.7 added emit_retry).
        return super().cancel(pool, *args, **kwargs)

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        """Celery's time limit handler; a hard limit whose message Celery puts back says so."""
        if not soft and self.task.acks_late and not acks_on_timeout(self.task):
            self.__dict__[PUT_BACK] = True
        return super().on_timeout(soft, timeout)

    def amend_context(self, context: Any) -> None:
        """The context Celery's main process writes with names the process that ran the task,
        and whether Celery cancelled it."""
        pid = self.worker_pid
        if pid is not None and pool_kind() == "gevent":
            pid = os.getpid()  # Celery's gevent pool gives the greenlet's id
        context.worker_pid = pid
        if self.__dict__.get(CANCELLED):
            setattr(context, CANCELLED, True)
        if self.__dict__.get(PUT_BACK):
            setattr(context, PUT_BACK, True)
