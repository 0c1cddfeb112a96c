"""What the worker knows of one running delivery of a fenced task: :class:`Attempt`.

Celery hands one request object through a task's prerun, body, result writes and postrun;
the attempt rides on it, and this module alone puts it there and reads it
(:func:`begin`, :func:`attempt_of`). The result backend sees an attempt only as a writer: its
token, its owner id, whether its writes go nowhere, and :meth:`Attempt.result_written`, through
which it reports each write's outcome. What that outcome means for the owner (the lease ended,
or lost to a newer token) is decided here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import states

from .. import events, metrics
from ..state import StoreOutcome, StoreResult

if TYPE_CHECKING:
    from ..owner import OwnedLease
    from ..store import LeaseStore

__all__ = ["FALSE_TAKEOVER_FACTOR", "Attempt", "attempt_of", "begin"]

logger = logging.getLogger(__name__)

#: The request attribute the attempt rides on (set and read only in this module).
_ATTRIBUTE = "fenced_attempt"

#: A taken-over owner whose SUCCESS comes within this many times its stage's deadline after
#: its last progress counts as a false takeover; one that needed longer was stuck, not slow.
FALSE_TAKEOVER_FACTOR = 10


@dataclass(eq=False)
class Attempt:
    """One delivery of a fenced task in a worker process, from ``task_prerun`` to ``task_postrun``.

    Attributes:
        lease: the lease it holds; ``None`` when the body does not run under one.
        skip: why the body does not run: the acquire outcome of a duplicate or finished
            delivery, or ``"unavailable"`` when the lease Redis could not be reached.
        error: a configuration error the body raises instead of running.
        retry_delay: seconds until the message of a ``retry()`` is due.
        reject_requeue: the body raised ``Reject(requeue=True)``: the lease waits, REQUEUED.
        write: the outcome code of its last result write (``"stored"``, ``"stale"``, …).
        result_stored: its SUCCESS was stored already (the late result of a lost owner), so
            the trace's own write of it is skipped.
    """

    lease: OwnedLease | None = None
    skip: str | None = None
    error: BaseException | None = None
    retry_delay: float = 0.0
    reject_requeue: bool = False
    write: str | None = None
    result_stored: bool = False

    # -- what the result backend reads ------------------------------------------------------

    def token_for(self, task_id: str) -> int | None:
        """The fencing token of a write for ``task_id``; ``None`` when this attempt holds no
        lease for it (``update_state(task_id=<another task>)``)."""
        lease = self.lease
        return lease.token if lease is not None and lease.task_id == task_id else None

    @property
    def owner_id(self) -> str:
        """The owner id of its lease (``""`` without one)."""
        return self.lease.owner_id if self.lease is not None else ""

    @property
    def task_name(self) -> str | None:
        """The task's name, for the log (``None`` without a lease)."""
        return self.lease.task_name if self.lease is not None else None

    @property
    def stage(self) -> str | None:
        """The stage the body last reported, for the log."""
        return self.lease.stage if self.lease is not None else None

    def overtaken_by_its_retry(self, state: str, outcome: StoreResult) -> bool:
        """A RETRY write refused because the retry message it sent already acquired the task
        (``retry()`` moved the lease to RETRYING first): no loss, the retry is the owner now."""
        retrying = self.lease is not None and self.lease.retrying
        return retrying and state == states.RETRY and outcome.code == StoreOutcome.STALE

    def result_written(self, store: LeaseStore, app: Any, state: str, outcome: StoreResult) -> None:
        """The backend wrote (or refused) one of this attempt's results: end or lose its lease.

        A stored READY or RETRY ends the lease (its activity is counted; a SUCCESS also its
        duration). A write refused for a newer token loses it: the loss is final, an early
        SUCCESS is counted as a false takeover, and Flower is sent ``task-fenced``.
        """
        self.write = outcome.code
        lease = self.lease
        if lease is None:
            return
        if outcome.code == StoreOutcome.STORED:
            if outcome.detail in ("DONE", "RETRYING") and not lease.ended:
                lease.ended = True
                duration = time.monotonic() - lease.started if state == states.SUCCESS else None
                lease.count_activity(ended=True, duration=duration)
        elif outcome.code == StoreOutcome.STALE and not self.overtaken_by_its_retry(state, outcome):
            current = int(outcome.detail) if outcome.detail.isdigit() else None
            self._fenced(store, app, state, current)

    def _fenced(self, store: LeaseStore, app: Any, state: str, current: int | None) -> None:
        lease = self.lease
        assert lease is not None
        lease.mark_lost("fenced: a newer token owns the task")
        if state == states.SUCCESS:
            # The old owner of a takeover finished after all, soon after its deadline: the
            # deadline was too tight (counted per stage, so `tune` never cuts that one).
            allowed, elapsed, _ = lease.no_progress_deadline(time.monotonic())
            shared = store.read(lease.task_id)
            if (
                shared is not None
                and shared.takeovers > 0
                and "cancelledAt" not in shared.raw
                and elapsed <= allowed * FALSE_TAKEOVER_FACTOR
            ):
                metrics.buffer.inc("owner_false_takeover_total", stage=lease.stage or "")
        metrics.buffer.flush(store)
        events.send_about(app, "task-fenced", lease, current_token=current, state=state)


def begin(request: Any, lease: OwnedLease | None = None) -> Attempt:
    """Start the attempt of ``request`` (at ``task_prerun``, or for a write made on its behalf)."""
    attempt = Attempt(lease=lease)
    setattr(request, _ATTRIBUTE, attempt)
    return attempt


def attempt_of(request: Any) -> Attempt | None:
    """The attempt riding on ``request``; ``None`` for a request no fenced attempt began
    (eager calls, writes from the worker's main process)."""
    attempt: Attempt | None = getattr(request, _ATTRIBUTE, None)
    return attempt
