"""The reaper: claims lapsed and expired leases and sends their tasks again.

:func:`reap` is one pass, a plain function that takes the time as a parameter; the Celery
task ``celery_fenced.reap`` (put on beat's schedule by :func:`celery_fenced.install`, and
sent at once by a heartbeat that gives a stalled lease up) calls it. Each task is claimed
atomically by ``claim.lua`` before anything is sent, so several reapers are safe; a claimed
task that nobody acquires within ``fenced_requeue_timeout`` is due again, so a reaper that
dies between claim and send loses nothing. Task ids that will be re-sent are never revoked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, states

from . import events, metrics, signals, tracing
from .apps import first_time, record_of
from .calls import PUBLISH_ID_HEADER
from .compat import outside_any_task
from .conf import DEFAULTS, check_settings_before_beat, ensure_conf
from .exceptions import ConfigurationError, TaskAbandonedError
from .state import ClaimOutcome, ClaimResult, LeaseState
from .store import lease_store_of

__all__ = [
    "DEFAULT_BATCH",
    "REAP_TASK_NAME",
    "SCHEDULE_NAME",
    "ReapReport",
    "install",
    "reap",
    "register_reaper_task",
    "request_reap",
    "resend",
]

logger = logging.getLogger("celery_fenced.reaper")

#: The name of the Celery task that runs one reaper pass.
REAP_TASK_NAME = "celery_fenced.reap"

#: How many leases one pass claims at most; the rest wait for the next pass.
DEFAULT_BATCH = 500

# Options signature_from_request() copies from delivery_info that are not send options.
_NOT_SEND_OPTIONS = ("redelivered", "is_eager")


@dataclass
class ReapReport:
    """What one pass did."""

    requeued: list[str] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    left: int = 0

    @property
    def claimed(self) -> int:
        """Tasks re-sent or abandoned by this pass."""
        return len(self.requeued) + len(self.abandoned)


def reap(app: Celery, now: float | None = None, limit: int = DEFAULT_BATCH) -> ReapReport:
    """Run one reaper pass over ``app``'s leases.

    Args:
        app: the Celery app (its result backend must be ``FencedRedisBackend``).
        now: the time, in seconds since the epoch, up to which index entries are looked
            at; ``None`` uses the Redis server's clock. Each lease is still re-validated
            by the claim script against the server's clock.
        limit: the most leases claimed in this pass.

    Returns:
        A :class:`ReapReport`; ``left`` counts due entries not looked at in this pass.
    """
    store = lease_store_of(app, "reap()")
    backend = app.backend
    conf = ensure_conf(app)
    now_ms = None if now is None else int(now * 1000)
    for dead, count in store.lapse_dead_workers().items():
        logger.warning(
            "worker %s is gone (its liveness record lapsed): its %d unstarted reservations are sent again now",
            dead,
            count,
        )
    task_ids = store.due_task_ids(limit + 1, now_ms=now_ms)
    report = ReapReport(left=max(0, len(task_ids) - limit))
    results = store.claim_due(
        task_ids[:limit],
        grace_ms=int(conf.takeover_grace * 1000),
        requeue_ms=int(conf.requeue_timeout * 1000),
        abandoned_meta=backend.abandoned_meta,
        expires_ms=backend.failure_expires_ms(),
    )
    for result in results:
        try:
            _handle_claim(app, result, report)
        except Exception:
            # One task's failure must not stop the others; its lease stays REQUEUED and
            # is due again after the requeue timeout.
            logger.exception("could not re-send task %s; it is due again later", result.task_id)
            report.failed.append(result.task_id)
    if results:
        metrics.buffer.flush(store)
    if report.claimed or report.left:
        logger.info(
            "reaper: %d re-sent, %d abandoned, %d failed, %d left for the next pass",
            len(report.requeued),
            len(report.abandoned),
            len(report.failed),
            report.left,
        )
    return report


def _handle_claim(app: Celery, result: ClaimResult, report: ReapReport) -> None:
    state = result.state
    if result.code == ClaimOutcome.REQUEUED and state is not None:
        resend(app, state, cause=result.cause)
        report.requeued.append(result.task_id)
        logger.warning(
            "takeover: task %s[%s] re-sent (cause=%s, takeovers=%d, last token=%d)",
            state.task_name,
            state.task_id,
            result.cause,
            state.takeovers,
            state.owner_token,
        )
        if result.cause in ("stalled", "gone", "unstarted"):
            metrics.buffer.inc("owner_takeover_total", cause=result.cause)
        _tell(app, state, result.cause, abandoned=False)
    elif result.code == ClaimOutcome.ABANDONED and state is not None:
        report.abandoned.append(result.task_id)
        logger.error(
            "abandoned: task %s[%s] taken over %d times; FAILURE(TaskAbandonedError) stored",
            state.task_name,
            state.task_id,
            state.takeovers,
        )
        _tell(app, state, result.cause, abandoned=True)
        # The chord part, later chain steps and errbacks, as after any FAILURE: this pass's
        # claim is the one that stored it, so they run once.
        app.backend.ended_without_owner(state.task_id, state.call, TaskAbandonedError.of(state.task_id), states.FAILURE)


def _tell(app: Celery, state: LeaseState, cause: str, *, abandoned: bool) -> None:
    """Send the takeover (or abandon) event for Flower and the ``task_taken_over`` signal."""
    events.send(
        app,
        "task-abandoned" if abandoned else "task-takeover",
        task_id=state.task_id,
        token=state.owner_token,
        stage=state.current_stage,
        attempt=state.attempt,
        takeovers=state.takeovers,
        cause=cause,
        name=state.task_name,
    )
    signals.task_taken_over.send(
        sender=state.task_name,
        task_id=state.task_id,
        cause=cause,
        takeovers=state.takeovers,
        abandoned=abandoned,
    )


def resend(app: Celery, state: LeaseState, cause: str = "resend") -> Any:
    """Send the original call of a claimed task again, under the same task id.

    Where OpenTelemetry records, the send is a ``celery_fenced.takeover`` span (attribute
    ``cause``) linked to the replaced attempt's span, and the message carries both
    contexts for the next attempt's span to link to.
    """
    if not state.call:
        raise ValueError(f"task {state.task_id} has no recorded call to send again")
    call = dict(state.call)
    options = dict(call.get("options") or {})
    for name in _NOT_SEND_OPTIONS:
        options.pop(name, None)
    headers = dict(options.pop("headers", None) or {})
    publish_id = state.raw.get("publishId")
    if publish_id:
        headers[PUBLISH_ID_HEADER] = publish_id  # a copy of the same run, not a new apply
    headers.pop(tracing.LINKS_HEADER, None)  # an earlier takeover's links are not this one's
    options["task_id"] = state.task_id
    with outside_any_task(), tracing.takeover_span(state.task_id, cause, state.raw) as trace_headers:
        # outside_any_task() keeps the message's own parent and root ids, not the reaper's.
        headers.update(trace_headers)
        return app.send_task(
            call.get("task") or state.task_name,
            args=call.get("args") or (),
            kwargs=call.get("kwargs") or {},
            headers=headers,
            add_to_parent=False,
            **options,
        )


def request_reap(app: Celery) -> None:
    """Send one ``celery_fenced.reap`` message now (it expires before the next beat tick)."""
    conf = ensure_conf(app)
    try:
        app.send_task(REAP_TASK_NAME, expires=max(1.0, conf.reaper_interval * 0.9), ignore_result=True)
    except Exception:
        logger.exception("could not send a reap message; beat's next tick will reap")


def register_reaper_task(app: Celery) -> None:
    """Register ``celery_fenced.reap`` on ``app`` (idempotent)."""
    if not first_time(app, "reaper task"):
        return

    def run_reaper() -> int:
        return reap(app).claimed

    app.task(
        name=REAP_TASK_NAME,
        ignore_result=True,
        send_events=False,
        shared=False,
        bind=False,
    )(run_reaper)


#: The beat schedule entry ``install()`` adds.
SCHEDULE_NAME = "celery_fenced.reap"


def install(app: Celery) -> None:
    """Put the reaper on ``app``'s beat schedule, every ``fenced_reaper_interval`` seconds.

    Deferred to ``on_after_configure``, so a later ``config_from_object`` cannot wipe it;
    beat checks again at start and warns if a hand-written ``beat_schedule`` replaced it.
    Calling it twice is harmless.
    """
    register_reaper_task(app)
    check_settings_before_beat(app)
    if not first_time(app, "beat schedule"):
        return
    if app.configured:
        _add_schedule(app)
    else:
        app.on_after_configure.connect(lambda **_: _add_schedule(app), weak=False)
    from celery.signals import beat_init

    beat_init.connect(_check_at_beat_start, weak=False, dispatch_uid="celery_fenced.beat_init")


def _add_schedule(app: Celery) -> None:
    try:
        interval = ensure_conf(app).reaper_interval
    except ConfigurationError:
        # Reported where it can stop the process in one line (worker, beat, CLI); a
        # client that only sends tasks is not stopped by it.
        interval = DEFAULTS["fenced_reaper_interval"]
    app.add_periodic_task(
        interval,
        app.signature(REAP_TASK_NAME, options={"expires": max(1.0, interval * 0.9)}),
        name=SCHEDULE_NAME,
    )


class _QuietReapSends(logging.Filter):
    """Beat's "Sending due task celery_fenced.reap" line, every few seconds, only at DEBUG.

    Beat keeps sending it (the workers' own reaper threads are the fallback for when every
    pool process is stuck), but a line per tick is noise in beat's INFO log.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.levelno != logging.INFO or not isinstance(args, tuple) or not args or args[0] != SCHEDULE_NAME:
            return True
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_QUIET_SENDS = _QuietReapSends()


def _check_at_beat_start(sender: Any = None, **_: Any) -> None:
    """Beat starts: quiet its reap lines; put the reaper back on the schedule of an installed
    app that lost it."""
    app: Any = getattr(sender, "app", None)
    if app is None or "beat schedule" not in record_of(app).done:
        return
    beat_log = logging.getLogger("celery.beat")
    if _QUIET_SENDS not in beat_log.filters:
        beat_log.addFilter(_QUIET_SENDS)
    if SCHEDULE_NAME in (app.conf.beat_schedule or {}):
        return
    logger.warning(
        "beat_schedule has no %r entry (a later beat_schedule assignment replaced it): "
        "adding it back; add it to your schedule by hand to silence this warning",
        SCHEDULE_NAME,
    )
    _add_schedule(app)
