"""What the fenced result backend reports after each write, and who hears it.

The backend only stores: each write's outcome goes, as a :class:`WriteReport`, to the one
hook of its app (kept in the app's record, set by :func:`set_hook`). In a worker the worker
side installs its own (:func:`~celery_fenced._worker.attempt.after_write`: the owner's lease
ends or is lost, refusals are counted, a lapse asks for a reap). Elsewhere :func:`log_write`
logs a refused write and sends ``stale_write_rejected``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import signals
from .._celery.apps import record_of
from .._lease.state import StoreOutcome, StoreResult

__all__ = ["WriteHook", "WriteReport", "log_write", "set_hook"]

logger = logging.getLogger("celery_fenced.backend")


@dataclass(frozen=True)
class WriteReport:
    """One write of the fenced backend and its outcome.

    Attributes:
        task_id: the task written.
        state: the Celery state written.
        token: the token it carried (``None``: a tokenless write).
        outcome: what ``store.lua`` answered.
        request: the request the write was made with (the worker side finds its attempt
            there; the backend reads nothing of it but the fence).
    """

    task_id: str
    state: str
    token: int | None
    outcome: StoreResult
    request: Any = None

    @property
    def current_token(self) -> int | None:
        """The newer token that refused a stale write."""
        detail = self.outcome.detail
        return int(detail) if self.outcome.code == StoreOutcome.STALE and detail.isdigit() else None


#: What hears each write of an app's backend: ``hook(backend, report)``. True when the write
#: is to be made again: it was refused as ``missing`` and the writer has its lease back.
WriteHook = Callable[[Any, WriteReport], bool | None]


def log_write(
    backend: Any,
    report: WriteReport,
    *,
    task_name: str | None = None,
    stage: str | None = None,
    overtaken_by_its_retry: bool = False,
) -> None:
    """Log a write that was not stored; signal ``stale_write_rejected`` for a stale one.

    The worker's hook adds what it knows of the writer: its task's name and stage, and
    whether the write was refused because its own retry already runs.
    """
    code = report.outcome.code
    if code == StoreOutcome.STORED:
        return
    task_id, state = report.task_id, report.state
    if overtaken_by_its_retry:
        # The retry's new owner holds the task now, and its STARTED must not be overwritten.
        logger.info("RETRY of task %s not stored: its retry already runs (token %s)", task_id, report.outcome.detail)
        return
    if code == StoreOutcome.STALE:
        logger.warning(
            "stale write dropped: task %s[%s] state=%s stage=%s token=%s current token=%s",
            task_name,
            task_id,
            state,
            stage,
            report.token,
            report.current_token,
        )
        signals.stale_write_rejected.send(
            sender=task_name, task_id=task_id, token=report.token, current_token=report.current_token, state=state
        )
    elif code == StoreOutcome.LAPSED:
        what = "request cancelled (a cold shutdown)" if state == "RETRY" else "worker lost"
        logger.warning("%s while running task %s: lease lapsed, the task will be taken over", what, task_id)
    elif code == StoreOutcome.MISSING:
        logger.warning(
            "write dropped: task %s[%s] state=%s token=%s: its lease is gone from Redis (the store lost "
            "data) and its owner does not have it back",
            task_name,
            task_id,
            state,
            report.token,
        )
    else:
        logger.info("write of %s for task %s dropped: %s (%s)", state, task_id, code, report.outcome.detail)


def set_hook(app: Any, hook: WriteHook) -> None:
    """Make ``hook`` hear the writes of ``app``'s backend (the worker side installs its own)."""
    record_of(app).write_hook = hook
