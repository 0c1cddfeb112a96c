"""Kept import path: the fenced result backend, :class:`celery_fenced.FencedRedisBackend`.

``celery_fenced.backend:FencedRedisBackend`` is the class path Celery's ``result_backend`` and
the ``fenced+redis://`` entry point name; the code lives in :mod:`celery_fenced._backend`.
"""

from ._backend.backend import FencedRedisBackend, FencedSentinelBackend

__all__ = ["FencedRedisBackend", "FencedSentinelBackend"]
