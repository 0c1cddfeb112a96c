"""Flower integration: lease fields on task pages and columns, and the token rule.

Flower 2.2 shows only ``celery.events.state.Task._fields``; this module extends that tuple
(each new field with a class default, else Flower's API answers 500) and wraps the event
state so that:

* an event carrying a token older than the newest seen for its task is ignored (a zombie
  can never flip the task's state or worker back);
* ``task-progress`` updates stage, token, attempt and the published progress details (the
  checkpoint a takeover resumes from) but keeps the task ``STARTED`` (so
  Flower's Terminate button stays), and brings a ``STALLED`` or ``TAKEOVER`` task back to
  ``STARTED`` once its current owner progresses;
* ``task-stalled`` and ``task-takeover`` show as the states ``STALLED`` and ``TAKEOVER``.

``celery fenced flower`` starts Flower with :mod:`.flowerconfig`, which calls
:func:`install`. Supported Flower versions: 2.2.x.
"""

from __future__ import annotations

import json
from typing import Any

from celery import states
from celery.events.state import State, Task

__all__ = ["LEASE_FIELDS", "TASK_COLUMNS", "ShownDetails", "install"]

#: Lease fields added to Flower's task view and API.
LEASE_FIELDS = ("stage", "token", "attempt", "takeovers", "cause", "reason", "details")

#: The task list columns ``celery fenced flower`` shows by default.
TASK_COLUMNS = "name,uuid,state,stage,token,attempt,takeovers,received,runtime,worker"

_RECOVERED_BY_PROGRESS = ("STALLED", "TAKEOVER", "LEASE-LOST")
_installed = False


class ShownDetails(dict[str, Any]):
    """Progress details that Flower's task page prints as JSON (its API returns the object)."""

    def __str__(self) -> str:
        return json.dumps(self, sort_keys=True, ensure_ascii=False)


def _token_of(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def install() -> None:
    """Patch Celery's event state for Flower (idempotent)."""
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
        kind = event.get("type", "")
        uuid = event.get("uuid")
        token = _token_of(event.get("token"))
        task = self.tasks.get(uuid) if uuid else None
        if kind.startswith("task-") and token is not None and task is not None:
            newest = _token_of(getattr(task, "token", None))
            if newest is not None and token < newest:
                return None  # a stale owner's event: counted by Flower, never applied
            if kind == "task-progress":
                for name in LEASE_FIELDS:
                    if event.get(name) not in (None, ""):  # an empty stage means "not yet known"
                        setattr(task, name, event[name])
                if isinstance(event.get("details"), dict):
                    task.details = ShownDetails(event["details"])
                task.token = token
                if task.state in _RECOVERED_BY_PROGRESS:
                    task.state = states.STARTED
                return None
        if kind == "task-progress":
            event = dict(event, type="task-started")  # first news of the task: it runs
        return original(self, event)

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
