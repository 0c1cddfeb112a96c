"""What rides on a Celery request while a fenced attempt runs, as the task class and the
result backend see it.

The worker side (:mod:`celery_fenced.worker.attempt`) puts an attempt on the request at
``task_prerun``; this module only names the attribute and the part of the attempt the rest
of the package may read, so the task class and the backend never import the worker side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .owner import OwnedLease

__all__ = ["RunningAttempt", "attempt_of", "put_attempt"]

#: The request attribute the attempt rides on.
_ATTRIBUTE = "fenced_attempt"


class RunningAttempt(Protocol):
    """One delivery of a fenced task in a worker process, as a writer of its results."""

    #: The lease it holds; ``None`` when the body does not run under one.
    lease: OwnedLease | None
    #: Why the body does not run (a duplicate or finished delivery, ``"unavailable"``).
    skip: str | None
    #: Seconds until the message of a ``retry()`` is due.
    retry_delay: float
    #: Its SUCCESS was stored already, by the task itself: the trace's write is skipped.
    result_stored: bool

    def token_for(self, task_id: str) -> int | None:
        """The token of a write for ``task_id`` (``None``: not this attempt's task)."""

    @property
    def owner_id(self) -> str:
        """The owner id of its lease (``""`` without one)."""

    def fence_run(self, task_id: str) -> str | None:
        """``fence_run`` of a READY result for ``task_id`` (:mod:`celery_fenced.finished`);
        ``None`` when it cannot carry one."""


def attempt_of(request: Any) -> RunningAttempt | None:
    """The attempt riding on ``request``; ``None`` for a request no fenced attempt began
    (eager calls, writes from the worker's main process, processes that run no worker)."""
    attempt: RunningAttempt | None = getattr(request, _ATTRIBUTE, None)
    return attempt


def put_attempt(request: Any, attempt: RunningAttempt) -> None:
    """Make ``attempt`` the one riding on ``request`` (the worker side, at ``task_prerun``)."""
    setattr(request, _ATTRIBUTE, attempt)
