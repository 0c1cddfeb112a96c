"""Celery events for Flower: what the heartbeat and the reaper saw, per task.

Types (each with ``uuid``, ``token``, ``stage`` and ``attempt``): ``task-progress`` (sent by
the heartbeat after an attempt's first renewal and after a renewal that published a new stage
or new details, and at once by the acquire of a takeover or a retry; a retry's carries
``cause`` :data:`RETRY_CAUSE`), ``task-stalled``,
``task-lease-lost``, ``task-takeover``, ``task-fenced`` and ``task-abandoned``; and Celery's
``task-failed`` for an attempt stopped at ``fenced_max_task_duration``; and, from the
operator's commands, Celery's ``task-revoked`` for a cancel and ``task-takeover`` for a
redrive (``cause`` :data:`CANCEL_CAUSE`, :data:`REDRIVE_CAUSE`). They go
through the app's event dispatcher with an explicit uuid (the heartbeat thread has no task
request), only when task events are on (``-E`` or ``worker_send_task_events``), and never
from ``progress()``. Sending is best effort: a broker error drops the event, not the task.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Protocol

from celery import Celery

from .._celery.apps import record_of
from .process import TELEMETRY

__all__ = [
    "CANCEL_CAUSE",
    "CELERY_EVENT_TYPES",
    "EVENT_TYPES",
    "REDRIVE_CAUSE",
    "RETRY_CAUSE",
    "EventSubject",
    "configure",
    "enabled",
    "send",
    "send_about",
]

logger = logging.getLogger("celery_fenced.events")

EVENT_TYPES = (
    "task-progress",
    "task-stalled",
    "task-lease-lost",
    "task-takeover",
    "task-fenced",
    "task-abandoned",
)

#: Celery's own events for what the package ended itself: an attempt past
#: ``fenced_max_task_duration`` (it ends as an ``Ignore``, for which the worker sends nothing),
#: and a task cancelled while no owner ran it (no worker hears of that cancel).
CELERY_EVENT_TYPES = ("task-failed", "task-revoked")

#: The ``cause`` of the events an operator's command sends, whatever this process's event
#: setting: ``celery fenced cancel`` sends Celery's ``task-revoked`` (with the cancel's token
#: and ``reason``), ``celery fenced redrive`` a ``task-takeover``. Flower's integration shows
#: them at once, whatever Celery's order of states says.
CANCEL_CAUSE = "cancel"
REDRIVE_CAUSE = "redrive"

#: The ``cause`` of an event about a Celery retry, not a takeover: the acquire of a retried
#: run (its ``task-progress``, with ``retries`` and ``reason``), and the reaper's
#: ``task-takeover`` when it sends a retry again whose message never started (the claim's
#: cause). Flower's integration shows both as a retry.
RETRY_CAUSE = "retry"


def configure(*, enabled: bool | None = None, hostname: str | None = None) -> None:
    """Set, for this process and its forks, whether events are on and the sender's name."""
    if enabled is not None:
        TELEMETRY.events_enabled = enabled
    if hostname is not None:
        TELEMETRY.events_hostname = hostname


def enabled(app: Celery) -> bool:
    """True when task events are on for this worker (``-E``) or by setting."""
    flag = TELEMETRY.events_enabled
    if flag is None:
        flag = bool(app.conf.worker_send_task_events)
    return bool(flag)


def _dispatcher(app: Celery) -> Any:
    """This process's dispatcher for ``app``, kept in the app's record (lock held)."""
    record = record_of(app)
    pid = os.getpid()
    if record.dispatcher is not None and record.dispatcher[0] == pid:
        return record.dispatcher[1]
    # None yet, or inherited through fork: its connection is the parent's.
    hostname = TELEMETRY.events_hostname or f"celery@{socket.gethostname()}"
    dispatcher = app.events.Dispatcher(
        app.connection_for_write(), hostname=hostname, enabled=True, buffer_while_offline=False
    )
    record.dispatcher = (pid, dispatcher)
    return dispatcher


def send(
    app: Celery,
    event_type: str,
    *,
    task_id: str,
    token: int,
    stage: str | None,
    attempt: int,
    always: bool = False,
    **fields: Any,
) -> bool:
    """Send one event about ``task_id``; returns False when events are off or sending failed.

    ``always`` sends it even where this process has events off (an operator's command, whose
    news no worker sends).
    """
    if event_type not in EVENT_TYPES and event_type not in CELERY_EVENT_TYPES:
        raise ValueError(f"unknown event type {event_type!r}")
    if not always and not enabled(app):
        return False
    try:
        with TELEMETRY.events_lock:
            _dispatcher(app).send(event_type, uuid=task_id, token=token, stage=stage or "", attempt=attempt, **fields)
    except Exception as exc:
        logger.debug("could not send %s for %s: %r", event_type, task_id, exc)
        with TELEMETRY.events_lock:
            record_of(app).dispatcher = None
        return False
    return True


class EventSubject(Protocol):
    """What an event about an attempt says of it (the owner's lease has these)."""

    @property
    def task_id(self) -> str:
        """The task id."""

    @property
    def task_name(self) -> str:
        """The task's registered name."""

    @property
    def token(self) -> int:
        """The attempt's fencing token."""

    @property
    def stage(self) -> str | None:
        """The stage the body last reported."""

    @property
    def attempt(self) -> int:
        """Executions of the task id that acquired, this one included."""


def send_about(app: Celery, event_type: str, lease: EventSubject, **fields: Any) -> None:
    """Send a task event about ``lease`` (its id, token, stage, attempt and name) plus ``fields``.

    Nothing is built when events are off: an attempt's first event is on every task's path.
    """
    if not enabled(app):
        return
    send(
        app,
        event_type,
        task_id=lease.task_id,
        token=lease.token,
        stage=lease.stage,
        attempt=lease.attempt,
        name=lease.task_name,
        **fields,
    )
