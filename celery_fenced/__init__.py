"""celery-fenced: progress-aware leases, fencing tokens and a fenced result backend for Celery.

Opt in per task with ``base=ProgressLeasedTask`` and ``result_backend = "fenced+redis://…"``;
put the reaper on beat's schedule with ``install(app)``.
"""

from __future__ import annotations

from .backend import FencedRedisBackend
from .exceptions import LeaseLostError, StaleOwnerError, TaskAbandonedError
from .reaper import install, reap
from .state import Checkpoint, LeaseState
from .task import ProgressLeasedTask

__all__ = [
    "Checkpoint",
    "FencedRedisBackend",
    "LeaseLostError",
    "LeaseState",
    "ProgressLeasedTask",
    "StaleOwnerError",
    "TaskAbandonedError",
    "install",
    "reap",
]

__version__ = "0.1.0"
