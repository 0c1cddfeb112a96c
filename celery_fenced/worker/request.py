"""The worker's request class for fenced tasks: main-process writes name the owner's process.

Celery writes some results from the worker's main process, without a token: a hard time
limit, a ``WorkerLostError`` after a prefork child died, ``Reject``, a revoke. They come with
a context rebuilt from the message, which does not say which process ran the task. This
request adds ``worker_pid`` to that context, so the fenced store matches such a write to
the lease's owner *process* (not only its host), and tells a copy that never started (no
pid) from the owner.

A process lost between accepting a task and taking its lease leaves no lease to lapse: before
Celery writes that ``WorkerLostError``, the request makes the task's reservation due, so the
reaper sends it again and the fenced store refuses the failure, as it does for an owner lost
while it held the lease.
"""

from __future__ import annotations

from typing import Any

from ..compat import ContextHookRequest, is_process_lost
from .runtime import reservation_writer_of

__all__ = ["FencedRequest"]


class FencedRequest(ContextHookRequest):
    """Celery's worker request; its context also carries the pid of the process running it,
    and a process accepting it ends the worker's hold on its reservation."""

    def on_accepted(self, pid: Any, time_accepted: float) -> None:
        """Celery's handler of a process accepting the task; the reservation is no longer held."""
        super().on_accepted(pid, time_accepted)
        writer = reservation_writer_of(self.task.app)
        if writer is not None:
            writer.started(self.id)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        """Celery's failure handler; a lost process's task first gets a reservation due now."""
        if is_process_lost(self, exc_info.exception):
            writer = reservation_writer_of(self.task.app)
            if writer is not None:
                writer.lost(self)
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def amend_context(self, context: Any) -> None:
        """The context Celery's main process writes with names the process that ran the task."""
        context.worker_pid = self.worker_pid
