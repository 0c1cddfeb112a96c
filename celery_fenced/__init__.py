"""celery-fenced: progress-aware leases, fencing tokens and a fenced result backend for Celery."""

from __future__ import annotations

from .exceptions import LeaseLostError, StaleOwnerError, TaskAbandonedError
from .lease import LeaseState

__all__ = [
    "LeaseLostError",
    "LeaseState",
    "StaleOwnerError",
    "TaskAbandonedError",
]

__version__ = "0.1.0"
