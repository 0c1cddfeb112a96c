"""What celery-fenced keeps per Celery app, beside the app rather than on it.

The parsed settings (:func:`~celery_fenced.conf.ensure_conf`), the one-time wiring steps
(:func:`first_time`), the hook that hears its backend's writes and, in a worker process, the
app's worker runtime are held in a weak mapping keyed by the app, so nothing is added to
Celery's object and a discarded app takes its entry with it. Nothing else in the package
keeps per-app state.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

__all__ = ["AppRecord", "all_records", "first_time", "record_of"]


@dataclass
class AppRecord:
    """What is kept for one app.

    Attributes:
        conf: its validated configuration.
        done: the one-time steps done for it.
        write_hook: what hears its backend's writes (see :mod:`celery_fenced._backend.writes`).
        runtime: its worker runtime in this process (see :mod:`celery_fenced._worker.runtime`).
        dispatcher: its event dispatcher and the pid of the process that made it.
        shared_store: where the process's threads are greenlets, the lease store its backends
            share, with what it was made for (see ``FencedRedisBackend.lease_store``).
    """

    conf: Any = None
    done: set[str] = field(default_factory=set)
    write_hook: Any = None
    runtime: Any = None
    dispatcher: tuple[int, Any] | None = None
    shared_store: tuple[Any, Any] | None = None


# Global: an app cannot carry its record, and a weak key lets a discarded app take it along.
_records: WeakKeyDictionary[Any, AppRecord] = WeakKeyDictionary()
_lock = threading.Lock()


def record_of(app: Any) -> AppRecord:
    """The record of ``app`` (created empty on first use)."""
    record = _records.get(app)
    if record is None:
        with _lock:
            record = _records.setdefault(app, AppRecord())
    return record


def first_time(app: Any, step: str) -> bool:
    """True the first time ``step`` is asked about for ``app``, False ever after (thread-safe)."""
    record = record_of(app)
    with _lock:
        if step in record.done:
            return False
        record.done.add(step)
        return True


def all_records() -> list[AppRecord]:
    """The records of every app alive in this process."""
    return list(_records.values())
