"""Kept import path: :class:`celery_fenced.ProgressLeasedTask` and its :class:`StageBlock`;
the code lives in :mod:`celery_fenced._task`."""

from ._task.task import ProgressLeasedTask, StageBlock

__all__ = ["ProgressLeasedTask", "StageBlock"]
