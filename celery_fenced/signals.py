"""Signals users can connect to (Celery's own ``Signal`` class).

Connect a receiver as with any Celery signal::

    from celery_fenced.signals import task_taken_over

    @task_taken_over.connect
    def on_takeover(sender, task_id, cause, takeovers, **kwargs):
        ...

``sender`` is the task name in every signal.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "lease_acquired",
    "lease_lost",
    "progress_stalled",
    "stale_write_rejected",
    "task_taken_over",
]

#: An attempt took the lease and its body is about to run: ``takeover`` when the reaper re-sent
#: the task (its owner stalled or was lost), ``retry`` when an earlier attempt asked for it
#: (``self.retry()``, ``autoretry_for``); a retry is not a takeover.
lease_acquired = Signal(
    name="lease_acquired",
    providing_args={"task_id", "token", "attempt", "takeover", "retry"},
)

#: An attempt made no progress within its deadline for ``stall_checks`` heartbeat ticks.
progress_stalled = Signal(
    name="progress_stalled",
    providing_args={"task_id", "token", "stage", "bound", "allowed", "elapsed", "on_stall"},
)

#: An attempt lost its lease (taken over, stalled and released, cancelled, expired).
lease_lost = Signal(
    name="lease_lost",
    providing_args={"task_id", "token", "stage", "reason"},
)

#: The reaper claimed a task and sent it again (``cause``: "stalled", "gone", "resend", …).
task_taken_over = Signal(
    name="task_taken_over",
    providing_args={"task_id", "cause", "takeovers", "abandoned"},
)

#: The fenced backend refused a write because a newer token owns the task.
stale_write_rejected = Signal(
    name="stale_write_rejected",
    providing_args={"task_id", "token", "current_token", "state"},
)
