"""The cluster's metrics in Redis: each process's deltas added up (``metrics.lua``,
``gaps.lua``), and the totals read back for Prometheus and ``celery fenced tune``.

What is counted, and how, is :mod:`celery_fenced._telemetry.metrics`'s; this module only stores it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .gateway import ScriptSet
from .keys import KeySpace
from .state import as_text

__all__ = ["MetricsStore"]


class MetricsStore:
    """The cluster's metric totals on one Redis client (the lease store's, with its scripts).

    Args:
        client: a redis-py client (the result backend's own client).
        scripts: the scripts on that client.
        keys: the key space.
    """

    def __init__(self, client: Any, scripts: ScriptSet, keys: KeySpace) -> None:
        self.client = client
        self.scripts = scripts
        self.keys = keys

    def add_metrics(self, deltas: Mapping[str, float], *, max_fields: int) -> None:
        """Add one process's counter and histogram deltas to the cluster totals (one script call)."""
        args: list[Any] = [max_fields]
        for field, value in deltas.items():
            args += [field, repr(float(value))]
        self.scripts.metrics(keys=[self.keys.metrics], args=args)

    def add_gaps(self, counts: Mapping[str, int], *, max_fields: int) -> None:
        """Add gap samples (``"task|stage|bucket" → count``) to the cluster's fine histograms."""
        args: list[Any] = [max_fields]
        for field, count in counts.items():
            args += [field, count]
        self.scripts.gaps(keys=[self.keys.gaps], args=args)

    def metric_fields(self) -> dict[str, float]:
        """The cluster totals: ``"name|labels[|part]" → value``."""
        return {as_text(k): float(v) for k, v in self.client.hgetall(self.keys.metrics).items()}

    def gap_fields(self) -> dict[str, int]:
        """The cluster's gap samples: ``"task|stage|bucket" → count``."""
        return {as_text(k): int(v) for k, v in self.client.hgetall(self.keys.gaps).items()}
