"""Operator actions on one task: cancel it for good, put an abandoned task back, look at it.

These are the functions behind ``celery fenced cancel``, ``redrive`` and ``inspect``. None of
them calls ``revoke()``: a revoked id is discarded by every worker for hours, and the reaper
re-sends under the same id.
"""

from __future__ import annotations

import logging

from celery import Celery, states
from celery.exceptions import TaskRevokedError

from .lease import LeaseState
from .reaper import request_reap

__all__ = ["cancel", "inspect", "redrive"]

logger = logging.getLogger("celery_fenced.control")


def _backend(app: Celery):  # type: ignore[no-untyped-def]
    backend = app.backend
    if not hasattr(backend, "lease_store"):
        raise TypeError(f"this needs the fenced result backend, not {type(backend).__name__}")
    return backend


def cancel(app: Celery, task_id: str, reason: str = "cancelled") -> str:
    """End a task for good: a fenced REVOKED result with a fresh token.

    The running owner learns it at its next renewal (its next ``progress()`` then raises
    ``LeaseLostError``; with ``fenced_interrupt_on_loss`` the body is interrupted), every
    later write of it is refused, and no later delivery runs the task.

    Returns:
        ``"cancelled"``, or ``"finished"`` when the task had already ended.
    """
    backend = _backend(app)

    def revoked_meta(token: int) -> object:
        return backend.encoded_meta(task_id, TaskRevokedError(reason), states.REVOKED, token)

    expires_ms = backend._expires_ms(states.REVOKED)
    code = backend.lease_store.cancel(task_id, revoked_meta, expires_ms=expires_ms)
    if code == "retry-later":  # a token was taken between reserve and script: take another
        code = backend.lease_store.cancel(task_id, revoked_meta, expires_ms=expires_ms)
    logger.warning("cancel of task %s: %s", task_id, code)
    if code == "cancelled":
        # A chord member's part is counted, as Celery counts a revoked one.
        state = backend.lease_store.read(task_id)
        call = state.call if state is not None else None
        backend.ended_without_owner(task_id, call, TaskRevokedError(reason), states.REVOKED)
    return str(code)


def redrive(app: Celery, task_id: str) -> str:
    """Put an ABANDONED task back for a fresh set of takeovers, and reap it now.

    Returns:
        ``"redriven"``, ``"not-abandoned"`` or ``"missing"``.
    """
    code = _backend(app).lease_store.redrive(task_id)
    if code == "redriven":
        logger.warning("redrive of task %s: due for a takeover now", task_id)
        request_reap(app)
    return str(code)


def inspect(app: Celery, task_id: str) -> LeaseState | None:
    """The lease of ``task_id``, or ``None`` when it has none."""
    state: LeaseState | None = _backend(app).lease_store.read(task_id)
    return state
