"""Flower integration: lease fields, the attempt history, the token rule, states that say what happened.

Flower 2.2 shows only ``celery.events.state.Task._fields``; this module extends that tuple
(each new field with a class default, else Flower's API answers 500) and wraps the event
state so that:

* an event carrying a token older than the newest seen for its task never changes the task
  (a zombie can never flip the task's state or worker back), though it is written into the
  history of the attempt that sent it;
* ``task-progress`` updates stage, token, attempt and the published progress details (the
  checkpoint a takeover resumes from) but keeps the task ``STARTED`` (so Flower's Terminate
  button stays), and brings a ``STALLED`` or ``TAKEOVER`` task back to ``STARTED`` once its
  current owner progresses;
* ``task-stalled`` shows as ``STALLED``, and so does a lease lost while the task waits to be
  taken over; ``task-takeover`` as ``TAKEOVER`` until the new owner starts;
* a retry is called a retry: the reaper's ``task-takeover`` of a retry whose message never
  started (cause ``retry``) keeps the task ``RETRY``, and the attempt that acquired after a
  retry says so in its reason (its acquire's event carries cause ``retry``);
* what an operator or the reaper did shows at once, whatever Celery's state order says (a
  READY state is normally never left): a task cancelled with ``celery fenced cancel`` shows
  ``REVOKED`` (the cancel sends the event itself), an abandoned one ``FAILURE`` with its
  ``TaskAbandonedError``, a redriven one ``TAKEOVER`` until its new attempt runs; a task
  the backend settled (cancelled, abandoned) is changed by no later event but a redrive, so
  Flower never shows a state the backend has moved past;
* ``attempts`` lists every attempt Flower heard of (:class:`AttemptHistory`): worker, token,
  started, ended, last stage, outcome and reason, the refused write of a zombie included;
  ``/api/task/info`` returns the list. The task page shows the lease fields and the
  attempts first, above Flower's own table.

``celery fenced flower`` starts Flower with :mod:`.flowerconfig`, which calls
:func:`install`. Supported Flower versions: 2.2.x.
"""

from __future__ import annotations

import html
import json
import re
from typing import Any

from celery import states
from celery.events.state import State, Task

from ..._telemetry.events import CANCEL_CAUSE, REDRIVE_CAUSE, RETRY_CAUSE
from ...exceptions import TaskAbandonedError
from ._attempts import (
    ATTEMPT_FIELDS,
    ATTEMPTS_LEGEND,
    OUTCOMES,
    TABLE_MARK,
    AttemptHistory,
    cancel_reason,
    is_cancel,
    token_of,
)

__all__ = [
    "ATTEMPTS_LEGEND",
    "ATTEMPT_FIELDS",
    "LEASE_FIELDS",
    "OUTCOMES",
    "TASK_COLUMNS",
    "AttemptHistory",
    "ShownDetails",
    "attempts_table",
    "install",
    "lease_first",
]

#: Lease fields added to Flower's task view and API.
LEASE_FIELDS = ("stage", "token", "attempt", "takeovers", "cause", "reason", "details", "attempts")

#: What ``task-progress`` updates on the task.
_PROGRESS_FIELDS = ("stage", "token", "attempt", "takeovers", "cause", "reason")

#: The task list columns ``celery fenced flower`` shows by default.
TASK_COLUMNS = "name,uuid,state,stage,token,attempt,takeovers,received,runtime,worker"

_RECOVERED_BY_PROGRESS = ("STALLED", "TAKEOVER")

_SETTLED = "fenced_settled"  # on a task: the READY state an operator or the reaper stored
_REDRIVEN = "fenced_redriven"  # on a task: the token of the last redrive heard (the abandon's)
_LOST = "fenced_lost"  # on a task: the token whose owner said it lost the lease
_installed = False  # global: Flower's classes are patched once per process


class ShownDetails(dict[str, Any]):
    """Progress details that Flower's task page prints as JSON (its API returns the object)."""

    def __str__(self) -> str:
        return json.dumps(self, sort_keys=True, ensure_ascii=False)


def _history_of(task: Task) -> AttemptHistory:
    history = getattr(task, "attempts", None)
    if not isinstance(history, AttemptHistory):
        history = AttemptHistory(history or ())
        task.attempts = history
    return history


def _apply(original: Any, state: State, event: dict[str, Any]) -> Any:
    """Apply one event to the task it is about, under the token rule."""
    kind = event.get("type", "")
    uuid = event.get("uuid")
    token = token_of(event.get("token"))
    task = state.tasks.get(uuid) if uuid else None
    cause = event.get("cause")
    newest = token_of(getattr(task, "token", None)) if task is not None else None
    # An event of an older token than the newest seen: a stale owner's, or the reaper's or an
    # operator's news of a step the backend has moved past. Counted by Flower, never applied.
    stale = token is not None and newest is not None and token < newest
    if kind == "task-takeover" and cause == REDRIVE_CAUSE:
        if stale:
            return None  # the redrive's new attempt (or a cancel) came first
        result = _moved_by_the_backend(original, state, event, "TAKEOVER", settled=False)
        setattr(state.tasks[uuid], _REDRIVEN, token)
        return result
    if task is not None and kind.startswith("task-") and getattr(task, _SETTLED, None):
        return None  # cancelled or abandoned: the backend moves it on only by a redrive
    if kind == "task-revoked" and cause == CANCEL_CAUSE:
        return None if stale else _moved_by_the_backend(original, state, event, states.REVOKED, settled=True)
    if kind == "task-abandoned":
        redriven = token_of(getattr(task, _REDRIVEN, None))
        if stale or (token is not None and redriven is not None and token <= redriven):
            return None  # abandoned before a redrive Flower already heard of
        return _moved_by_the_backend(original, state, event, states.FAILURE, settled=True)
    if kind.startswith("task-") and token is not None and task is not None:
        if stale:
            return None  # a stale owner's event: counted by Flower, never applied
        if kind == "task-progress":
            if token == token_of(getattr(task, _LOST, None)):
                return None  # sent before its owner lost the lease, and heard after
            for name in _PROGRESS_FIELDS:
                if event.get(name) not in (None, ""):  # an empty stage means "not yet known"
                    setattr(task, name, event[name])
            if isinstance(event.get("details"), dict):
                task.details = ShownDetails(event["details"])
            task.token = token
            if task.state in _RECOVERED_BY_PROGRESS:
                task.state = states.STARTED
            return None
        if kind == "task-lease-lost" and not is_cancel(str(event.get("reason") or "")):
            if task.state in (states.STARTED, "STALLED"):
                task.state = "STALLED"  # it waits to be taken over
            task.reason = event.get("reason")
            setattr(task, _LOST, token)
            return None
        if kind == "task-takeover":
            # Sent by the reaper's process: the task's worker stays the one that ran it.
            worker = task.worker
            result = original(state, _as_celery_event(event))
            task.worker = worker
            return result
    if kind == "task-progress":
        event = dict(event, type="task-started")  # first news of the task: it runs
    return original(state, _as_celery_event(event))


def _moved_by_the_backend(original: Any, state: State, event: dict[str, Any], shown: str, *, settled: bool) -> Any:
    """Show ``shown``, what the backend now stores (or, for a redrive, what the task waits for).

    Celery's state order keeps a READY state against every later event but a SUCCESS, and
    ranks REVOKED below FAILURE: an operator's cancel or redrive, or the reaper's abandon,
    moves the task whatever Flower showed. Sent by another process than the task's worker,
    the event leaves the task's worker as it was. A settled task (cancelled, abandoned)
    takes no later event but a redrive.
    """
    uuid = event.get("uuid")
    task = state.tasks.get(uuid) if uuid else None
    worker = task.worker if task is not None else None
    result = original(state, _as_celery_event(event))
    task = state.tasks.get(uuid) if uuid else None
    if task is None:
        return result
    if worker is not None:
        task.worker = worker
    task.state = shown
    token = token_of(event.get("token"))
    if token is not None:
        task.token = token
    if shown == states.REVOKED:
        task.reason = cancel_reason(event)
    if not settled:  # a redrive: the abandoned FAILURE is gone from the backend
        task.exception = task.traceback = task.result = None
        task.reason = "redriven: waiting for a new owner"
    setattr(task, _SETTLED, shown if settled else None)
    return result


def _as_celery_event(event: dict[str, Any]) -> dict[str, Any]:
    """The Celery event that says what a package event means for the task's state."""
    kind = event.get("type", "")
    if kind == "task-lease-lost":
        if is_cancel(str(event.get("reason") or "")):
            return dict(event, type="task-revoked", terminated=False, expired=False, signum=None)
        return dict(event, type="task-stalled")  # first news of the task: it waits to be taken over
    if kind == "task-takeover" and event.get("cause") == RETRY_CAUSE:
        return dict(event, type="task-retried")  # a retry sent again: still a retry, not a TAKEOVER
    if kind == "task-abandoned":
        error = TaskAbandonedError.of(str(event.get("uuid")))
        return dict(event, type="task-failed", exception=repr(error), traceback="")
    return event


def install() -> None:
    """Patch Celery's event state and Flower's task page (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    Task._fields = tuple(Task._fields) + tuple(f for f in LEASE_FIELDS if f not in Task._fields)
    for name in LEASE_FIELDS:
        if not hasattr(Task, name):
            setattr(Task, name, None)
    original = State.event

    def event(self: State, event: dict[str, Any]) -> Any:
        result = _apply(original, self, event)
        uuid = event.get("uuid")
        task = self.tasks.get(uuid) if uuid and str(event.get("type", "")).startswith("task-") else None
        if task is not None:
            _history_of(task).heard(event)
        return result

    State.event = event
    try:
        from flower.utils import template as flower_template
        from flower.views import tasks as flower_tasks
    except ImportError:
        return
    for name in LEASE_FIELDS[:4]:
        flower_tasks.TASK_COLUMNS.setdefault(name, name.capitalize())
    # Flower's label maker upper-cases "eta" wherever it appears ("DETAils"); its templates
    # take the module's functions at each render, so the field's label is set here.
    humanize = flower_template.humanize

    def label(obj: Any, type: str | None = None) -> Any:
        return "Details" if obj == "details" and type is None else humanize(obj, type)

    flower_template.humanize = label
    _show_the_lease_first(flower_tasks.TaskView, humanize, label)


#: Where Flower 2.2's task page begins its own table of the task's fields.
_FLOWER_TABLE = '<section class="detail-card task-details-card"'


def _show_the_lease_first(view: Any, humanize: Any, label: Any) -> None:
    """The task page's lease rows and attempts come first, above Flower's own table.

    Flower prints every field through its generic row, below its own ones (about 1,100 px
    down): once the page is rendered, those rows are taken out and shown in a section of
    their own above that table, the attempts as a table.
    """
    render_string = view.render_string

    def render(self: Any, template_name: str, **kwargs: Any) -> bytes:
        page: bytes = render_string(self, template_name, **kwargs)
        task = kwargs.get("task")
        if template_name != "task.html" or task is None:
            return page
        return lease_first(page.decode(), task, humanize, label).encode()

    view.render_string = render


def lease_first(page: str, task: Any, humanize: Any = None, label: Any = None) -> str:
    """Flower's task page with the lease fields and the attempts in a section above its table."""
    history = getattr(task, "attempts", None)
    if _FLOWER_TABLE not in page:  # another page layout: the attempts table stays in its row
        if isinstance(history, AttemptHistory):
            page = page.replace(TABLE_MARK, attempts_table(history, humanize))
        return page
    name_of = label or (lambda name: name.capitalize())
    rows = []
    for name in LEASE_FIELDS:
        shown = name_of(name)
        page = re.sub(
            rf'\s*<div class="detail-row">\s*<dt>{re.escape(html.escape(str(shown)))}</dt>\s*<dd>.*?</dd>\s*</div>',
            "",
            page,
            count=1,
            flags=re.DOTALL,
        )
        value = getattr(task, name, None)
        if value is None or name == "attempts":
            continue
        cells = f"<dt>{html.escape(str(shown))}</dt><dd>{html.escape(str(value))}</dd>"
        rows.append(f'<div class="detail-row">{cells}</div>')
    table = attempts_table(history, humanize) if isinstance(history, AttemptHistory) and history else ""
    if not rows and not table:
        return page
    attempts = f'<div class="px-3 pb-2"><p class="page-eyebrow mt-3 mb-2">Attempts</p>{table}</div>' if table else ""
    section = (
        '<section class="detail-card fenced-lease-card" aria-label="Lease">'
        f'<dl class="detail-list">{"".join(rows)}</dl>{attempts}</section>\n  '
    )
    return page.replace(_FLOWER_TABLE, section + _FLOWER_TABLE, 1)


def attempts_table(history: AttemptHistory, humanize: Any = None) -> str:
    """The attempt history as an HTML table (what the task page shows)."""

    def cell(name: str, value: Any) -> str:
        wrap = "" if name in ("started", "ended", "reason") else ' style="white-space: nowrap"'
        if value is None:
            return "<td>-</td>"
        if name in ("started", "ended") and humanize is not None:
            value = humanize(value, type="time")
        return f"<td{wrap}>{html.escape(str(value))}</td>"

    head = "".join(f'<th style="white-space: nowrap">{name.capitalize()}</th>' for name in ATTEMPT_FIELDS)
    rows = "".join(
        "<tr>" + "".join(cell(name, entry.get(name)) for name in ATTEMPT_FIELDS) + "</tr>" for entry in history
    )
    table = '<table class="table table-sm fenced-attempts">'
    legend = f'<caption class="fenced-legend small">{html.escape(ATTEMPTS_LEGEND)}</caption>'
    return f"{table}{legend}<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
