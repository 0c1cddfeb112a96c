"""Kept import path: :mod:`celery_fenced.worker.request`; the worker side lives in
:mod:`celery_fenced._worker`."""
