"""Kept import path: the cluster's metric totals as Redis holds them (:func:`read_totals`);
the code lives in :mod:`celery_fenced._telemetry`."""

from ._telemetry.metrics import ClusterCollector, read_totals

__all__ = ["ClusterCollector", "read_totals"]
