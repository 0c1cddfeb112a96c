"""Operator actions on one task: cancel it for good, put an abandoned task back, look at it.

These are the functions behind ``celery fenced cancel``, ``redrive`` and ``inspect``. None of
them calls ``revoke()``: a revoked id is discarded by every worker for hours, and the reaper
re-sends under the same id.
"""

from __future__ import annotations

import logging

from celery import Celery, states
from celery.exceptions import TaskRevokedError

from .._lease.state import CancelOutcome, LeaseState, LeaseStatus, RedriveOutcome
from .._lease.store import lease_store_of
from .._reaper.reaper import request_reap
from .._telemetry import events
from .._telemetry.events import CANCEL_CAUSE, REDRIVE_CAUSE

__all__ = ["abandoned", "cancel", "inspect", "redrive", "redrive_many"]

logger = logging.getLogger("celery_fenced.control")


def cancel(app: Celery, task_id: str, reason: str = "cancelled", *, unknown_too: bool = False) -> str:
    """End a task for good: a fenced REVOKED result with a fresh token.

    The running owner learns it at its next renewal (its next ``progress()`` then raises
    ``LeaseLostError``; with ``fenced_interrupt_on_loss`` the body is interrupted), every
    later write of it is refused, and no later delivery runs the task.

    A task id with neither lease nor result is unknown (a typo, or a task that never ran)
    and nothing is stored for it, unless ``unknown_too``: a task still waiting in the queue
    has neither either, and is cancelled before it starts.

    Returns:
        ``"cancelled"``, ``"finished"`` when the task had already ended, or ``"unknown"``.
    """
    store = lease_store_of(app, "cancel()")
    backend = app.backend

    def revoked_meta(token: int) -> object:
        return backend.encoded_meta(task_id, TaskRevokedError(reason), states.REVOKED, token)

    expires_ms = backend.expires_ms(states.REVOKED)
    answer = store.cancel(task_id, revoked_meta, expires_ms=expires_ms, unknown_too=unknown_too)
    if answer.code == CancelOutcome.RETRY_LATER:  # a token was taken between reserve and script: take another
        answer = store.cancel(task_id, revoked_meta, expires_ms=expires_ms, unknown_too=unknown_too)
    code = answer.code
    if code == CancelOutcome.CANCELLED:
        logger.info("task %s cancelled", task_id)
        # A chord member's part is counted, as Celery counts a revoked one.
        state = store.read(task_id)
        call = state.call if state is not None else None
        backend.ended_without_owner(task_id, call, TaskRevokedError(reason), states.REVOKED)
        # Flower shows REVOKED at once, whether an owner runs the task (it hears of the cancel
        # only at its next renewal) or nobody does (waiting, received, taken over). The event
        # carries the cancel's token: no event of an earlier owner changes the task after it.
        events.send(
            app,
            "task-revoked",
            task_id=task_id,
            token=state.owner_token if state is not None else 0,
            stage=state.current_stage if state is not None else None,
            attempt=state.attempt if state is not None else 0,
            always=True,
            terminated=False,
            expired=False,
            signum=None,
            cause=CANCEL_CAUSE,
            reason=reason,
        )
    return str(code)


def redrive(app: Celery, task_id: str) -> str:
    """Put an ABANDONED task back for a fresh set of takeovers, and reap it now.

    Returns:
        ``"redriven"``, ``"not-abandoned"`` or ``"missing"``.
    """
    return redrive_many(app, [task_id])[task_id]


def redrive_many(app: Celery, task_ids: list[str]) -> dict[str, str]:
    """:func:`redrive` for several tasks, with one reap message for all of them."""
    store = lease_store_of(app, "redrive_many()")
    codes = {task_id: str(store.redrive(task_id)) for task_id in task_ids}
    redriven = [task_id for task_id, code in codes.items() if code == RedriveOutcome.REDRIVEN]
    for task_id in redriven:
        logger.info("redrive of task %s: due for a takeover now", task_id)
        _tell_flower_of_the_redrive(app, store.read(task_id))
    if redriven:
        request_reap(app)
    return codes


def _tell_flower_of_the_redrive(app: Celery, state: LeaseState | None) -> None:
    """Flower leaves the abandoned FAILURE at once (the result is gone): the task waits for its
    takeover. Sent before the reap is asked for, so it comes before the new attempt's news."""
    if state is None:
        return
    events.send(
        app,
        "task-takeover",
        task_id=state.task_id,
        token=state.owner_token,
        stage=state.current_stage,
        attempt=state.attempt,
        always=True,
        takeovers=state.takeovers,
        cause=REDRIVE_CAUSE,
        name=state.task_name,
    )


def abandoned(app: Celery, limit: int = 1000) -> list[LeaseState]:
    """The dead letters: tasks whose takeovers ran out (``ABANDONED``), oldest first."""
    store = lease_store_of(app, "abandoned()")
    task_ids = store.abandoned_task_ids(limit)
    states = [state for state in store.read_many(task_ids) if state.status == LeaseStatus.ABANDONED]
    store.forget_abandoned(set(task_ids) - {state.task_id for state in states})
    return states


def inspect(app: Celery, task_id: str) -> LeaseState | None:
    """The lease of ``task_id``, or ``None`` when it has none."""
    state: LeaseState | None = lease_store_of(app, "inspect()").read(task_id)
    return state
