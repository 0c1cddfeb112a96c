"""What the worker knows of one running delivery of a fenced task: :class:`Attempt`.

Celery hands one request object through a task's prerun, body, result writes and postrun;
the attempt rides on it (:func:`begin` puts it there, :func:`~celery_fenced.running.attempt_of`
reads it). The result backend sees an attempt only as a writer
(:class:`~celery_fenced.running.RunningAttempt`): its token, its owner id, whether its writes
go nowhere. It reports each write's outcome to :func:`after_write`, the worker's write hook;
what that outcome means for the owner (the lease ended, or lost to a newer token) is decided
here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import states

from .. import events, metrics, tracing
from ..finished import run_text
from ..reaper import request_reap
from ..running import attempt_of, put_attempt
from ..state import StoreOutcome
from ..writes import WriteReport, log_write

if TYPE_CHECKING:
    from ..heartbeat import Heartbeat
    from ..owner import OwnedLease
    from ..store import LeaseStore

__all__ = ["FALSE_TAKEOVER_FACTOR", "Attempt", "after_write", "announce_the_end", "attempt_of", "begin"]

logger = logging.getLogger(__name__)

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
        heartbeat: the process's heartbeat that serves its lease.
    """

    lease: OwnedLease | None = None
    skip: str | None = None
    error: BaseException | None = None
    retry_delay: float = 0.0
    reject_requeue: bool = False
    write: str | None = None
    result_stored: bool = False
    heartbeat: Heartbeat | None = None

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

    def fence_run(self, task_id: str) -> str | None:
        """``fence_run`` of a READY result for ``task_id`` (:mod:`celery_fenced.finished`);
        ``None`` when this attempt holds no lease for it, or its publish id cannot be carried."""
        lease = self.lease
        if lease is None or lease.task_id != task_id:
            return None
        return run_text(lease.publish_id, lease.attempt, lease.takeovers)

    @property
    def task_name(self) -> str | None:
        """The task's name, for the log (``None`` without a lease)."""
        return self.lease.task_name if self.lease is not None else None

    @property
    def stage(self) -> str | None:
        """The stage the body last reported, for the log."""
        return self.lease.stage if self.lease is not None else None

    def result_written(self, store: LeaseStore, app: Any, report: WriteReport) -> None:
        """The backend wrote (or refused) one of this attempt's results: end or lose its lease.

        A stored READY or RETRY ends the lease (its activity is counted; a SUCCESS also its
        duration). A write refused for a newer token loses it: the loss is final, an early
        SUCCESS is counted as a false takeover, and Flower is sent ``task-fenced``.
        """
        outcome = report.outcome
        self.write = outcome.code
        lease = self.lease
        if lease is None:
            return
        if outcome.code == StoreOutcome.STORED:
            if outcome.detail in ("DONE", "RETRYING") and lease.end():
                duration = time.monotonic() - lease.started if report.state == states.SUCCESS else None
                lease.count_activity(ended=True, duration=duration)
                announce_the_end(app, lease)
        elif outcome.code == StoreOutcome.STALE and not report.overtaken_by_its_retry:
            self._fenced(store, app, report.state, report.current_token)

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
        tracing.write_refused(lease, state, current)
        events.send_about(app, "task-fenced", lease, current_token=current, state=state)


def announce_the_end(app: Any, lease: OwnedLease) -> None:
    """An attempt Flower knows of ends: tell it the last stage and details, if they are news
    (the task's page then shows where it finished, not where the last renewal saw it)."""
    if lease.announced and lease.announce_the_end():  # most attempts were never announced
        events.send_about(
            app, "task-progress", lease, version=lease.version, takeovers=lease.takeovers, details=dict(lease.details)
        )


def begin(request: Any, lease: OwnedLease | None = None) -> Attempt:
    """Start the attempt of ``request`` (at ``task_prerun``, or for a write made on its behalf)."""
    attempt = Attempt(lease=lease)
    put_attempt(request, attempt)
    return attempt


def after_write(backend: Any, report: WriteReport) -> None:
    """The worker's write hook: log and count a refused write, ask for a reap after a lapse,
    and tell the writing attempt what became of its write."""
    code = report.outcome.code
    writer = report.writer
    if code != StoreOutcome.STORED:
        log_write(backend, report)
        if code == StoreOutcome.STALE and not report.overtaken_by_its_retry:
            metrics.buffer.inc("owner_fencing_rejected_total")
            if writer is None:
                metrics.buffer.flush(backend.lease_store)  # an owner's count is flushed with its loss
        elif code == StoreOutcome.LAPSED:
            request_reap(backend.app)
    if isinstance(writer, Attempt):
        writer.result_written(backend.lease_store, backend.app, report)
