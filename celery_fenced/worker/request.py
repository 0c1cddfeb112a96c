"""Kept import path: :class:`celery_fenced.FencedRequest`, the request class to derive from
when a task sets a ``Request`` of its own; the code lives in :mod:`celery_fenced._worker`."""

from .._worker.request import FencedRequest

__all__ = ["FencedRequest"]
