"""What ``celery fenced`` prints: the rows of ``status``, a lease for ``inspect``, plain tables.

Pure functions of what the commands read (:class:`~celery_fenced._lease.state.LeaseState`, the
workers' liveness records, the lease hash's fields) and the server's clock; the commands in
:mod:`celery_fenced._operator.cli` read, act and echo.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from .._celery.compat import UTC
from .._lease.fields import is_time, typed
from .._lease.liveness_store import hostname_of
from .._lease.state import LeaseState

__all__ = [
    "COUNTS_LEGEND",
    "LEASE_HEADERS",
    "WORKER_HEADERS",
    "lease_cells",
    "lease_row",
    "render_lease",
    "seconds",
    "shown_fields",
    "table",
    "typed_fields",
    "worker_cells",
    "worker_row",
]

#: The columns of ``status``'s table.
LEASE_HEADERS = (
    "TASK ID",
    "NAME",
    "STATUS",
    "OWNER",
    "TOKEN",
    "STAGE",
    "SINCE PROGRESS",
    "LEFT",
    "ATTEMPT",
    "TAKEOVERS",
)

#: What ATTEMPT and TAKEOVERS count, under ``status``'s table.
COUNTS_LEGEND = (
    "ATTEMPT: runs that took the lease (the first, each Celery retry, each takeover); "
    "TAKEOVERS: the reaper's re-sends of a stalled or dead owner's task (a retry is not one)"
)

#: What ``inspect`` says beside a field.
_NOTES = {
    "attempt": "runs that took the lease: the first, each Celery retry, each takeover",
    "takeovers": "the reaper's re-sends of a stalled or dead owner's task; retries are not counted",
    "ownerToken": "the owner's",
    "cancelToken": "the cancel's: it fences every later write",
}

#: The columns of ``status --workers``'s table.
WORKER_HEADERS = ("WORKER", "PID", "RESERVED", "LEFT", "STATE")


def seconds(value: float | None) -> str:
    """A duration in seconds as a table shows it (``-`` for none)."""
    return "-" if value is None else f"{value:.1f}s"


def _left(until_ms: int, now_ms: int) -> float:
    """Seconds from ``now_ms`` until ``until_ms``; 0 once it has passed (the status says what then)."""
    return max(0, until_ms - now_ms) / 1000


def lease_row(state: LeaseState, now_ms: int) -> dict[str, Any]:
    """One lease as ``status --json`` prints it (an element of its array): ages and times left in
    seconds at ``now_ms``."""
    ended = state.status in ("DONE", "ABANDONED")
    reserved = state.status == "RESERVED"
    # After a cancel the hash's ownerToken is the cancel's: the owner's is shown as the token.
    cancelled = state.raw.get("cancelledAt") is not None
    owner_token: int | None = state.owner_token
    if cancelled:
        kept = state.raw.get("cancelledOwnerToken")
        owner_token = int(kept) if kept is not None and str(kept).isdigit() else None
    return {
        "task_id": state.task_id,
        "name": state.task_name,
        "status": state.status,
        "owner": f"{state.reserved_by} (received)" if reserved else state.owner_id,
        "reserved_by": state.reserved_by or None,
        "seconds_since_received": None if state.reserved_at is None else (now_ms - state.reserved_at) / 1000,
        "token": owner_token,
        "cancel_token": state.owner_token if cancelled else None,
        "stage": state.current_stage,
        "seconds_since_progress": None if state.last_progress_at is None else (now_ms - state.last_progress_at) / 1000,
        "seconds_left": None if ended or state.lease_expire_at is None else _left(state.lease_expire_at, now_ms),
        "attempt": state.attempt,
        "takeovers": state.takeovers,
    }


def lease_cells(row: Mapping[str, Any]) -> tuple[str, ...]:
    """A :func:`lease_row` as the cells of ``status``'s table (:data:`LEASE_HEADERS`)."""
    return (
        row["task_id"],
        row["name"],
        row["status"],
        row["owner"] or "-",
        "-" if row["token"] is None else str(row["token"]),
        row["stage"] or "-",
        seconds(row["seconds_since_progress"]),
        seconds(row["seconds_left"]),
        str(row["attempt"]),
        str(row["takeovers"]),
    )


def worker_row(worker_id: str, until_ms: int, reserved: int, now_ms: int) -> dict[str, Any]:
    """One worker's liveness record as ``status --workers --json`` prints it (one element of its array)."""
    parts = worker_id.rsplit("/", 2)  # "<hostname>/<pid>/<start>"
    return {
        "worker": worker_id,
        "hostname": hostname_of(worker_id),
        "pid": int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None,
        "reserved": reserved,
        "seconds_left": _left(until_ms, now_ms),
        "alive": until_ms > now_ms,
    }


def worker_cells(row: Mapping[str, Any]) -> tuple[str, ...]:
    """A :func:`worker_row` as the cells of ``status --workers``'s table (:data:`WORKER_HEADERS`)."""
    return (
        row["hostname"],
        str(row["pid"] or "-"),
        str(row["reserved"]),
        seconds(row["seconds_left"]),
        "alive" if row["alive"] else "lapsed: its reservations are sent again at the next reaper pass",
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Rows under their headers, each column as wide as its widest cell."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = [headers, *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def typed_fields(raw: Mapping[str, str]) -> dict[str, Any]:
    """The lease hash with its values typed by its schema (:mod:`celery_fenced._lease.fields`)."""
    return typed(raw)


def shown_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The typed lease as ``inspect`` shows it: after a cancel, ``ownerToken`` is the owner's
    token and ``cancelToken`` the cancel's.

    In the hash a cancel's token takes ``ownerToken`` (it fences every later write) and the
    owner's moves to ``cancelledOwnerToken``; ``None`` when no owner ever held the lease (a
    task cancelled in the queue), or the cancel came before the hash kept it.
    """
    shown = dict(fields)
    if shown.get("cancelledAt") is None:
        return shown
    shown["cancelToken"] = shown.get("ownerToken")
    shown["ownerToken"] = shown.pop("cancelledOwnerToken", None)
    return shown


def render_lease(task_id: str, fields: Mapping[str, Any], now_ms: int) -> str:
    """A lease for people: one field per line, times as ISO dates with their age, the call as a block."""
    lines = [f"task {task_id}"]
    names = sorted(name for name in fields if name != "call")
    width = max([len(name) for name in names], default=0)
    for name in names:
        value = fields[name]
        if is_time(name) and isinstance(value, int) and value > 0:
            moment = datetime.fromtimestamp(value / 1000, tz=UTC)
            age = (now_ms - value) / 1000
            when = f"{abs(age):.1f}s ago" if age >= 0 else f"in {-age:.1f}s"
            shown = f"{moment.isoformat(timespec='milliseconds').replace('+00:00', 'Z')} ({when})"
        elif isinstance(value, Mapping):
            shown = json.dumps(value, sort_keys=True, ensure_ascii=False)
        else:
            shown = str(value) if value not in ("", None) else "-"
        note = f"  ({_NOTES[name]})" if name in _NOTES else ""
        lines.append(f"  {name.ljust(width)}  {shown}{note}")
    call = fields.get("call")
    if isinstance(call, Mapping):
        lines.append("  call:")
        lines.append(f"    {call.get('task') or fields.get('taskName', '')}(")
        for arg in call.get("args") or ():
            lines.append(f"      {arg!r},")
        for key, arg in (call.get("kwargs") or {}).items():
            lines.append(f"      {key}={arg!r},")
        lines.append("    )")
        for key, option in sorted((call.get("options") or {}).items()):
            if option not in (None, "", [], {}):
                lines.append(f"    {key}: {json.dumps(option, sort_keys=True, default=str)}")
    elif call:
        lines.append(f"  call: {call}")
    return "\n".join(lines)
