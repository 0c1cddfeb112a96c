"""What the worker knows of one running delivery of a fenced task: :class:`Attempt`.

Celery hands one request object through a task's prerun, body, result writes and postrun;
the attempt rides on it (:func:`begin` puts it there, :func:`attempt_of` reads it), and only
the worker side reads it. The result backend sees none of it: at acquire the worker puts a
:class:`~celery_fenced._backend.fence.WriterFence` on the request, plain data the backend
fences each write with (:func:`fence_for`). The backend reports each write's outcome to
:func:`after_write`, the worker's write hook; what that outcome means for the owner (the
lease ended, or lost to a newer token) is decided here.

An attempt's fields are written only by its own methods, which the worker's side calls: the
lease's life (:mod:`celery_fenced._worker.lifecycle`), ``task_prerun`` when the lease cannot be
taken (:mod:`celery_fenced._worker.hooks`) and the write hook.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import states

from .._backend.fence import SKIPPED, WriterFence, put_fence
from .._backend.writes import WriteReport, log_write
from .._lease.state import StoreOutcome
from .._reaper.reaper import request_reap
from .._task.running import ATTEMPT_ATTRIBUTE
from .._telemetry import events, tracing
from .._telemetry.process import TELEMETRY
from .heartbeat import take_back

if TYPE_CHECKING:
    from .._lease.store import LeaseStore
    from .._task.owner import Activity, OwnedLease
    from .heartbeat import Heartbeat

__all__ = [
    "FALSE_TAKEOVER_FACTOR",
    "Attempt",
    "after_write",
    "attempt_of",
    "begin",
    "false_takeover",
    "fence_for",
    "overtaken_by_its_retry",
    "report_the_end",
    "skip",
]

logger = logging.getLogger("celery_fenced.worker.attempt")

#: A taken-over owner whose SUCCESS comes within this many times its stage's deadline after
#: its last progress (the time it ran, its silences left out) counts as a false takeover; one
#: that needed longer was stuck, not slow.
FALSE_TAKEOVER_FACTOR = 10


def false_takeover(allowed: float, elapsed: float, silent: float) -> bool:
    """Whether the takeover of an owner that then stored a SUCCESS was false (its deadline too
    tight), by what the owner did after its last progress.

    ``elapsed`` seconds passed between its last progress and its SUCCESS, ``silent`` of them
    with its process not running (its heartbeat silent: SIGSTOP, a VM pause), under a deadline
    of ``allowed`` seconds. An owner that *ran* past its deadline and then finished within
    ``FALSE_TAKEOVER_FACTOR`` deadlines was slow, not stuck: the deadline was too tight. An
    owner that did not run past it (it was frozen, or its lease went for another reason: Redis
    out of reach) lost nothing to the deadline, and a frozen owner's takeover was right, whatever
    it does once it thaws.
    """
    ran = elapsed - silent
    return allowed < ran <= allowed * FALSE_TAKEOVER_FACTOR


@dataclass(eq=False)
class Attempt:
    """One delivery of a fenced task in a worker process, from ``task_prerun`` to ``task_postrun``.

    Attributes:
        lease: the lease it holds; ``None`` when the body does not run under one.
        skip: why the body does not run: the acquire outcome of a duplicate or finished
            delivery, or ``"unavailable"`` when the lease Redis could not be reached.
        error: a configuration error the body raises instead of running.
        reject_requeue: the body raised ``Reject(requeue=True)``: the lease waits, REQUEUED.
        write: the outcome code of its last result write (``"stored"``, ``"stale"``, …).
        heartbeat: the process's heartbeat that serves its lease.
    """

    lease: OwnedLease | None = None
    skip: str | None = None
    error: BaseException | None = None
    reject_requeue: bool = False
    write: str | None = None
    heartbeat: Heartbeat | None = None

    # -- what happens to it (the worker side) -------------------------------------------------

    def hold(self, lease: OwnedLease, heartbeat: Heartbeat) -> None:
        """The body runs under ``lease``, served by ``heartbeat``."""
        self.lease = lease
        self.heartbeat = heartbeat

    def skip_as(self, reason: str) -> None:
        """The body does not run: ``reason`` is the acquire's outcome, or ``"unavailable"``
        (the lease Redis could not be reached: the body sends the task again)."""
        self.skip = reason

    def fail_with(self, error: BaseException) -> None:
        """The body raises ``error`` instead of running (a configuration error, or a lease that
        could not be acquired on too many deliveries in a row)."""
        self.error = error

    def rejected(self, requeue: bool) -> None:
        """The body raised ``Reject``; with ``requeue`` its lease waits, REQUEUED."""
        self.reject_requeue = requeue

    def result_written(self, store: LeaseStore, app: Any, report: WriteReport) -> None:
        """The backend wrote (or refused) one of this attempt's results: end or lose its lease.

        A stored READY or RETRY ends the lease (its activity is counted; a SUCCESS also its
        duration). A write refused for a newer token loses it: the loss is final, an early
        SUCCESS is counted as a false takeover, and Flower is sent ``task-fenced`` (unless the
        retry it sent owns the task already: :func:`overtaken_by_its_retry`).
        """
        outcome = report.outcome
        self.write = outcome.code
        lease = self.lease
        if lease is None:
            return
        if outcome.code == StoreOutcome.STORED:
            if outcome.detail in ("DONE", "RETRYING"):
                activity = lease.end()
                if activity is not None:
                    duration = time.monotonic() - lease.started if report.state == states.SUCCESS else None
                    report_the_end(app, lease, activity, duration)
        elif outcome.code == StoreOutcome.STALE and not overtaken_by_its_retry(report, lease):
            self._fenced(store, app, report.state, report.current_token)
        elif outcome.code == StoreOutcome.MISSING:
            lease.mark_lost("its lease is gone from Redis (the store lost data)")

    def _fenced(self, store: LeaseStore, app: Any, state: str, current: int | None) -> None:
        lease = self.lease
        assert lease is not None
        lease.mark_lost("fenced: a newer token owns the task")
        if state == states.SUCCESS:
            # The old owner of a takeover finished after all: if it ran on past its deadline
            # (not frozen), the deadline was too tight (counted per stage and task, so `tune`
            # never cuts that one).
            now = time.monotonic()
            allowed, elapsed, _ = lease.no_progress_deadline(now)
            heartbeat = self.heartbeat
            silent = heartbeat.silent_between(now - elapsed, now) if heartbeat is not None else 0.0
            if false_takeover(allowed, elapsed, silent):
                shared = store.read(lease.task_id)
                if shared is not None and shared.takeovers > 0 and shared.cancelled_at is None:
                    TELEMETRY.metrics.inc("owner_false_takeover_total", stage=lease.stage or "", task=lease.task_name)
        TELEMETRY.metrics.flush(store)
        tracing.write_refused(lease.span, lease.token, state, current)
        events.send_about(app, "task-fenced", lease, current_token=current, state=state)


def report_the_end(app: Any, lease: OwnedLease, activity: Activity, duration: float | None = None) -> None:
    """The lease of an attempt ended: count the activity its end took (``duration``: the run
    time of an attempt that stored its SUCCESS), and tell Flower, when it knows the attempt,
    the last stage and details if they are news (the task's page then shows where it
    finished, not where the last renewal saw it)."""
    updates, stages, sample_gaps, announce = activity
    TELEMETRY.metrics.count_activity(updates, stages, sample_gaps=sample_gaps, duration=duration, task=lease.task_name)
    if announce:
        events.send_about(
            app, "task-progress", lease, version=lease.version, takeovers=lease.takeovers, details=dict(lease.details)
        )


def fence_for(lease: OwnedLease) -> WriterFence:
    """The fence of ``lease``'s result writes (built once per attempt)."""
    return WriterFence(
        task_id=lease.task_id,
        token=lease.token,
        owner_id=lease.owner_id,
        publish_id=lease.publish_id,
        attempt=lease.attempt,
        takeovers=lease.takeovers,
    )


def attempt_of(request: Any) -> Attempt | None:
    """The attempt riding on ``request``; ``None`` for a request no fenced attempt began
    (eager calls, writes from the worker's main process, processes that run no worker)."""
    attempt: Attempt | None = getattr(request, ATTEMPT_ATTRIBUTE, None)
    return attempt


def begin(request: Any, lease: OwnedLease | None = None) -> Attempt:
    """Start the attempt of ``request`` (at ``task_prerun``, or for a write made on its behalf,
    whose request then carries ``lease``'s fence)."""
    attempt = Attempt(lease=lease)
    setattr(request, ATTEMPT_ATTRIBUTE, attempt)
    if lease is not None:
        put_fence(request, fence_for(lease))
    return attempt


def skip(request: Any, attempt: Attempt, why: str) -> None:
    """The delivery of ``request`` does not run (``why``): its body is not called, and every
    write made for it goes nowhere."""
    attempt.skip_as(why)
    put_fence(request, SKIPPED)


def overtaken_by_its_retry(report: WriteReport, lease: OwnedLease | None) -> bool:
    """A RETRY write refused because the retry message it sent already acquired the task
    (``retry()`` moved the lease to RETRYING first): no loss, the retry is the owner now."""
    return (
        lease is not None
        and lease.retrying
        and report.state == states.RETRY
        and report.outcome.code == StoreOutcome.STALE
    )


def after_write(backend: Any, report: WriteReport) -> bool:
    """The worker's write hook: log and count a refused write, ask for a reap after a lapse,
    and tell the writing attempt what became of its write.

    The writing attempt is the one on the write's request, for a write that carried its token.
    A write refused because its lease is gone from Redis (the store lost data) is made again
    (True) once its owner has the lease back (:func:`~celery_fenced._worker.heartbeat.take_back`);
    an owner that cannot have it back (a thawed one) stores nothing.
    """
    code = report.outcome.code
    # attempt_of(), inlined: every write's path
    writer: Attempt | None = getattr(report.request, ATTEMPT_ATTRIBUTE, None) if report.token is not None else None
    if (
        code == StoreOutcome.MISSING
        and writer is not None
        and writer.lease is not None
        and not writer.lease.ended
        and take_back(backend.lease_store, writer.lease, f"{report.state} write")
    ):
        return True
    if code != StoreOutcome.STORED:
        lease = writer.lease if writer is not None else None
        overtaken = overtaken_by_its_retry(report, lease)
        log_write(
            backend,
            report,
            task_name=lease.task_name if lease is not None else None,
            stage=lease.stage if lease is not None else None,
            overtaken_by_its_retry=overtaken,
        )
        if code == StoreOutcome.STALE and not overtaken:
            TELEMETRY.metrics.inc("owner_fencing_rejected_total")
            if writer is None:
                TELEMETRY.metrics.flush(backend.lease_store)  # an owner's count is flushed with its loss
        elif code == StoreOutcome.LAPSED:
            request_reap(backend.app)
    if writer is not None:
        writer.result_written(backend.lease_store, backend.app, report)
    return False
