"""What celery-fenced keeps per Celery app, beside the app rather than on it.

The parsed settings (:func:`~celery_fenced.conf.ensure_conf`) and the one-time wiring steps
(:func:`first_time`) are held in a weak mapping keyed by the app, so nothing is added to
Celery's object and a discarded app takes its entry with it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

__all__ = ["AppRecord", "first_time", "record_of"]


@dataclass
class AppRecord:
    """What is kept for one app: its validated configuration and the steps done for it."""

    conf: Any = None
    done: set[str] = field(default_factory=set)


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
