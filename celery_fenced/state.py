"""Kept import path: :class:`celery_fenced.Checkpoint` and :class:`celery_fenced.LeaseState`;
the code lives in :mod:`celery_fenced._lease`."""

from ._lease.state import Checkpoint, LeaseState

__all__ = ["Checkpoint", "LeaseState"]
