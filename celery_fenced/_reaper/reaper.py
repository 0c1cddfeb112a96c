"""The reaper: claims lapsed and expired leases and sends their tasks again.

:func:`reap` is one pass, a plain function that takes the time as a parameter. Each task is
claimed atomically by ``claim.lua`` before anything is sent, so several reapers are safe; a
claimed task that nobody acquires within ``fenced_requeue_timeout`` is due again, so a reaper
that dies between claim and send loses nothing. Task ids that will be re-sent are never revoked.

Where a pass runs, and where no reap ever goes:

* in a thread of every worker's main process, every ``fenced_reaper_interval`` seconds
  (:mod:`celery_fenced._worker.reaper_thread`);
* in beat's own process, when :func:`install` put it on beat's schedule: beat's
  ``celery_fenced.reap`` entry runs the pass where beat runs (``ReapTask.apply_async``), and
  sends no task message, so the user's ``task_routes`` and queues never decide where it goes,
  and no message waits in a queue nothing consumes;
* at once, when something asks for it (:func:`request_reap`: a heartbeat that gave a stalled
  lease up, a lapsed lease's write, a redrive): the reaper thread of the process is woken, or a
  ``celery_fenced.reap`` *control* message (Celery's broadcast, through the pidbox exchange,
  never a task queue) wakes the reaper thread of the worker named.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery import Celery, Task, states
from celery.result import EagerResult
from celery.signals import beat_embedded_init, beat_init
from celery.utils import uuid
from redis.exceptions import ResponseError

from .. import signals
from .._celery.apps import first_time, record_of
from .._celery.compat import outside_any_task
from .._celery.headers import HANDED_OFF_BY_HEADER, PASSED_ON_HEADER, PUBLISH_ID_HEADER
from .._celery.startup import exit_in_one_line
from .._lease.gateway import denied_commands_text, denied_redis_commands
from .._lease.liveness_store import hostname_of
from .._lease.state import ClaimOutcome, ClaimResult, LeaseState
from .._lease.store import is_fenced, lease_store_of
from .._telemetry import events, tracing
from .._telemetry.events import RETRY_CAUSE
from .._telemetry.process import TELEMETRY
from ..conf import DEFAULTS, add_defaults, ensure_conf
from ..exceptions import ConfigurationError, TaskAbandonedError

__all__ = [
    "DEFAULT_BATCH",
    "REAP_COMMAND",
    "REAP_TASK_NAME",
    "SCHEDULE_NAME",
    "ReapReport",
    "ReapTask",
    "failure_text",
    "install",
    "reap",
    "register_reaper_task",
    "request_reap",
    "resend",
    "resend_replacement",
    "send_call",
]

logger = logging.getLogger("celery_fenced.reaper")

#: The name of the Celery task that runs one reaper pass.
REAP_TASK_NAME = "celery_fenced.reap"

#: The control command that wakes a worker's reaper thread: a broadcast, never a task message.
REAP_COMMAND = "celery_fenced.reap"

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
    for dead, count in store.liveness.lapse_dead_workers().items():
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
        TELEMETRY.metrics.flush(store)
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
    if result.code == ClaimOutcome.REQUEUED and state is not None and result.cause == "handoff":
        resend_replacement(app, state)
        report.requeued.append(result.task_id)
        logger.warning(
            "hand-off: task %s[%s] token=%s: its replacement has not started: sent again",
            state.task_name,
            state.task_id,
            state.handoff_token,
        )
    elif result.code == ClaimOutcome.REQUEUED and state is not None:
        resend(app, state, cause=result.cause)
        report.requeued.append(result.task_id)
        if result.cause == RETRY_CAUSE:
            # Celery's retry message did not start in time: sent again, still a retry.
            logger.warning(
                "retry: task %s[%s] re-sent (cause=retry: its retry did not start by its eta plus "
                "fenced_requeue_timeout; a retry, not a takeover; last token=%d)",
                state.task_name,
                state.task_id,
                state.owner_token,
            )
        else:
            logger.warning(
                "takeover: task %s[%s] re-sent (cause=%s, takeovers=%d, last token=%d)",
                state.task_name,
                state.task_id,
                result.cause,
                state.takeovers,
                state.owner_token,
            )
        if result.cause in ("stalled", "gone", "unstarted"):
            TELEMETRY.metrics.inc("owner_takeover_total", cause=result.cause)
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
    with (
        outside_any_task(),
        tracing.takeover_span(
            state.task_id, cause, token=state.owner_token, traceparent=state.trace_context
        ) as trace_headers,
    ):
        # outside_any_task() keeps the message's own parent and root ids, not the reaper's.
        return send_call(
            app,
            state.task_id,
            state.call,
            task_name=state.task_name,
            publish_id=state.publish_id,
            # An earlier takeover's links are not this one's; an earlier pass-on is not this one's.
            headers={
                tracing.LINKS_HEADER: None,
                PASSED_ON_HEADER: None,
                # the replacement's run, not the replaced one's
                HANDED_OFF_BY_HEADER: str(state.handoff_token) if state.handoff_token else None,
                **trace_headers,
            },
        )


def resend_replacement(app: Celery, state: LeaseState) -> Any:
    """Send the recorded replacement of a hand-off again (``handoffCall``: the signature as its
    owner sent it, every id in it frozen and every publish named after the replaced run), so
    a copy of a replacement that was only late does not run twice."""
    if not state.handoff_call:
        raise ValueError(f"task {state.task_id} has no recorded replacement to send again")
    with outside_any_task():
        return app.signature(dict(state.handoff_call)).apply_async()


def send_call(
    app: Celery,
    task_id: str,
    call: Mapping[str, Any],
    *,
    task_name: str,
    publish_id: str = "",
    headers: dict[str, Any] | None = None,
) -> Any:
    """Send a recorded call (see :func:`~celery_fenced._task.calls.recorded_call`) under ``task_id``.

    ``publish_id`` marks the message as a copy of the same run, not a new apply; ``headers``
    are set on the message (a ``None`` value removes the recorded header of that name).
    """
    call = dict(call)
    options = dict(call.get("options") or {})
    for name in _NOT_SEND_OPTIONS:
        options.pop(name, None)
    message_headers = dict(options.pop("headers", None) or {})
    if publish_id:
        message_headers[PUBLISH_ID_HEADER] = publish_id
    for name, value in (headers or {}).items():
        if value is None:
            message_headers.pop(name, None)
        else:
            message_headers[name] = value
    options["task_id"] = task_id
    with outside_any_task():
        return app.send_task(
            call.get("task") or task_name,
            args=call.get("args") or (),
            kwargs=call.get("kwargs") or {},
            headers=message_headers,
            add_to_parent=False,
            **options,
        )


def request_reap(app: Celery, worker: str | None = None) -> None:
    """Have a reaper pass run now, where no task process can park it.

    In a worker's main process, its reaper thread is woken. Elsewhere (a prefork child whose
    heartbeat gave a lease up, the ``celery fenced`` command), a ``celery_fenced.reap`` control
    message goes to ``worker`` (the node name of the worker this process belongs to), or
    else to every worker whose liveness record is live: Celery's broadcast, which no
    ``task_routes`` or queue choice changes, and which waits in no queue. A worker with remote
    control off (``worker_enable_remote_control = False``) does not hear it: its reaper
    thread takes the task over at its next pass.
    """
    reaper = _reaper_thread_here(app)
    if reaper is not None:
        reaper.wake()
        return
    try:
        destination = [worker] if worker else _live_workers(app)
        if destination:
            app.control.broadcast(REAP_COMMAND, destination=destination, reply=False)
    except Exception:
        logger.exception("could not ask a worker for a reap; the workers' next passes will reap")


def _reaper_thread_here(app: Celery) -> Any:
    """The reaper thread of this process for ``app``: a worker's main process has one."""
    runtime = record_of(app).runtime
    if runtime is None or getattr(runtime, "pid", None) != os.getpid():
        return None
    return getattr(runtime, "reaper", None)


def _live_workers(app: Celery) -> list[str]:
    """The node names of the workers whose liveness record is live (fenced workers of ``app``)."""
    store = lease_store_of(app, "request_reap()")
    now_ms = store.server_time_ms()
    return sorted({hostname_of(worker_id) for worker_id, until, _ in store.liveness.workers() if until > now_ms})


class ReapTask(Task):
    """``celery_fenced.reap``: one reaper pass. In beat's process, sending it runs it there.

    Beat's scheduler calls ``apply_async`` for each due entry: in the process that runs beat
    for this app (``beat_init``), the pass runs at once, in that process, and nothing is sent.
    So beat's reap needs no worker to consume it, whatever the user's ``task_routes`` and
    queues, and no reap message ever waits in a queue. Anywhere else, ``apply_async`` sends a
    message as for any task, for those who schedule it otherwise.
    """

    _failing: str | None = None  # the error last logged by a pass in beat, so an outage logs once

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any) -> Any:
        if "runs beat" not in record_of(self.app).done:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        claimed = 0
        try:
            claimed = reap(self.app).claimed
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if text != ReapTask._failing:
                logger.warning(
                    "reaper pass in beat failed (%s); beat tries again at its next tick", failure_text(self.app, exc)
                )
                ReapTask._failing = text
        else:
            if ReapTask._failing is not None:
                logger.warning("reaper passes in beat work again")
                ReapTask._failing = None
        return EagerResult(task_id or uuid(), claimed, states.SUCCESS)


def failure_text(app: Celery, exc: BaseException) -> str:
    """What a reaper pass that raised ``exc`` logs: the error and, for an error Redis answered,
    the commands the lease Redis user may not run and how to grant them (a script that runs a
    denied command fails naming only the script)."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ResponseError):
        try:
            denied = denied_redis_commands(app.backend.client)
        except Exception:  # the reason is the error itself; the look is only a hint
            denied = []
        if denied:
            text += f"; {denied_commands_text(denied)}"
    return text


def register_reaper_task(app: Celery) -> None:
    """Register ``celery_fenced.reap`` on ``app`` (idempotent)."""
    if not first_time(app, "reaper task"):
        return

    def run_reaper() -> int:
        return reap(app).claimed

    app.task(
        name=REAP_TASK_NAME,
        base=ReapTask,
        ignore_result=True,
        send_events=False,
        shared=False,
        bind=False,
    )(run_reaper)
    beat_init.connect(_beat_runs_here, weak=False, dispatch_uid="celery_fenced.beat_runs_here")
    beat_init.connect(_check_redis_at_beat_start, weak=False, dispatch_uid="celery_fenced.beat_checks_redis")
    beat_embedded_init.connect(_beat_runs_here, weak=False, dispatch_uid="celery_fenced.beat_embedded_runs_here")


def _beat_runs_here(sender: Any = None, **_: Any) -> None:
    """This process runs beat for ``sender.app``: its reap entries run here from now on."""
    app = getattr(sender, "app", None)
    if app is not None:
        record_of(app).done.add("runs beat")


def _check_redis_at_beat_start(sender: Any = None, **_: Any) -> None:
    """Beat starts with ``celery_fenced.reap`` on its schedule: as a worker does at its start,
    stop with one line naming the commands the lease Redis user may not run and the fix,
    rather than fail every pass. A Redis that cannot be reached yet is not checked (it may
    come back; each pass says so)."""
    app = getattr(sender, "app", None)
    if app is None or not _reaps_in(sender) or not is_fenced(app):
        return
    denied = denied_redis_commands(app.backend.client)
    if denied:
        with exit_in_one_line():
            raise ConfigurationError(f"{denied_commands_text(denied)}; beat runs {REAP_TASK_NAME} with this user")


def _reaps_in(service: Any) -> bool:
    """Whether a beat service's schedule runs ``celery_fenced.reap``."""
    try:
        entries = service.scheduler.schedule.values()
        return any(getattr(entry, "task", None) == REAP_TASK_NAME for entry in entries)
    except Exception:  # a scheduler that cannot list its entries here: not checked
        logger.debug("could not read beat's schedule", exc_info=True)
        return False


#: The beat schedule entry ``install()`` adds.
SCHEDULE_NAME = "celery_fenced.reap"


def install(app: Celery) -> None:
    """Put the reaper on ``app``'s beat schedule, every ``fenced_reaper_interval`` seconds.

    Deferred to ``on_after_configure``, so a later ``config_from_object`` cannot wipe it;
    beat checks again at start and warns if a hand-written ``beat_schedule`` replaced it.
    Calling it twice is harmless.
    """
    register_reaper_task(app)
    add_defaults(app)
    _check_settings_before_beat(app)
    if not first_time(app, "beat schedule"):
        return
    if app.configured:
        _add_schedule(app)
    else:
        app.on_after_configure.connect(lambda **_: _add_schedule(app), weak=False)
    from celery.signals import beat_init

    beat_init.connect(_check_at_beat_start, weak=False, dispatch_uid="celery_fenced.beat_init")


def _check_settings_before_beat(app: Celery) -> None:
    """Make ``celery beat`` stop with one line on a bad setting, before its scheduler starts.

    Beat builds the result backend while it sets up its schedule, before any signal of its
    own; the app's ``on_after_finalize`` comes earlier, and this receiver acts only under
    the ``beat`` command (idempotent).
    """
    if not first_time(app, "beat settings check"):
        return

    def check(sender: Any = None, **_: Any) -> None:
        import click

        context = click.get_current_context(silent=True)
        if context is not None and context.info_name == "beat":
            with exit_in_one_line():
                ensure_conf(app)

    app.on_after_finalize.connect(check, weak=False)


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

    Beat runs the pass in its own process at each tick (nothing is sent, whatever the line
    says); what a pass did is logged by the reaper itself, and a line per tick is noise.
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
