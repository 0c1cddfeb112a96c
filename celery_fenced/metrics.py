"""The seed's metrics, counted in each process and aggregated in Redis for the whole cluster.

Counting is in memory (a dict under a lock, never on the ``progress()`` path: progress
updates are counted from the lease's version by the heartbeat). Each process flushes its
deltas with one script call: with its heartbeat tick, or right after a rare event (a
takeover, a refused write). ``celery fenced metrics --port N`` serves the totals to
Prometheus, so prefork children that come and go lose nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = [
    "BUCKETS",
    "COUNTERS",
    "HISTOGRAMS",
    "MetricsBuffer",
    "buffer",
    "count_lease_activity",
    "read_totals",
]

logger = logging.getLogger("celery_fenced.metrics")

#: Counter names and their help text (Prometheus adds nothing: the names carry ``_total``).
COUNTERS: Mapping[str, str] = {
    "owner_heartbeat_total": "Heartbeat checks of a held lease.",
    "owner_lease_renew_total": "Lease renewals accepted.",
    "owner_lease_renew_rejected_total": "Lease renewals refused (taken over, claimed, ended).",
    "owner_progress_update_total": "progress() calls (real progress reported by task bodies).",
    "owner_no_progress_timeout_total": "Leases that made no progress within their stage deadline.",
    "owner_takeover_total": "Tasks re-sent by the reaper, by cause (stalled: owner alive; gone: lease expired).",
    "owner_fencing_rejected_total": "Writes refused because a newer token owned the task.",
    "owner_false_takeover_total": "Takeovers whose old owner later tried to store a SUCCESS (deadline too tight).",
    "owner_stream_idle_timeout_total": "Streams that went quiet for longer than their idle timeout.",
}

#: Histogram names and their help text.
HISTOGRAMS: Mapping[str, str] = {
    "owner_stage_duration_seconds": "Time spent in each stage, by stage.",
    "owner_task_total_duration_seconds": "Run time of an attempt that stored its result.",
    "owner_ai_first_token_duration_seconds": "Time from the start of a stream to its first chunk.",
}

#: Histogram bucket upper bounds, seconds.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _labels(labels: Mapping[str, str] | None) -> str:
    if not labels:
        return ""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


_series_names: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}


def _series(name: str, labels: Mapping[str, str]) -> str:
    """``"name|k=v,…"``, built once per name and labels (stage names repeat)."""
    key = (name, tuple(labels.items()))
    try:
        return _series_names[key]
    except KeyError:
        series = _series_names[key] = f"{name}|{_labels(labels)}"
        return series


class MetricsBuffer:
    """The metric deltas of one process, waiting for the next flush."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deltas: dict[str, float] = defaultdict(float)
        # Histograms: per series, the count of each bucket alone (made cumulative by take()),
        # so that an observation is one bisect and one increment.
        self._observed: dict[str, list[float]] = {}

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Add to a counter."""
        if name not in COUNTERS:
            raise KeyError(f"unknown counter {name!r}")
        if amount:
            with self._lock:
                self._deltas[_series(name, labels)] += amount

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Record one observation of a histogram."""
        if name not in HISTOGRAMS:
            raise KeyError(f"unknown histogram {name!r}")
        base = _series(name, labels)
        slot = bisect_left(BUCKETS, value)  # the first bucket whose bound is >= value
        with self._lock:
            series = self._observed.get(base)
            if series is None:
                series = self._observed[base] = [0.0] * (len(BUCKETS) + 3)  # buckets, +Inf, sum, count
            series[slot] += 1
            series[-2] += value
            series[-1] += 1

    def take(self) -> dict[str, float]:
        """Take the pending deltas (they are gone from the buffer)."""
        with self._lock:
            deltas, self._deltas = dict(self._deltas), defaultdict(float)
            observed, self._observed = self._observed, {}
        totals = defaultdict(float, deltas)  # given-back deltas may hold the same series
        for base, series in observed.items():
            running = 0.0
            for bound, count in zip(BUCKETS, series, strict=False):
                running += count
                if running:
                    totals[f"{base}|bucket|{bound}"] += running
            totals[f"{base}|bucket|+Inf"] += running + series[len(BUCKETS)]
            totals[f"{base}|sum"] += series[-2]
            totals[f"{base}|count"] += series[-1]
        return dict(totals)

    def give_back(self, deltas: Mapping[str, float]) -> None:
        """Put deltas back after a failed flush, so nothing is lost."""
        with self._lock:
            for key, value in deltas.items():
                self._deltas[key] += value

    def flush(self, store: Any) -> None:
        """Add the pending deltas to the cluster totals (one script call); keep them on error."""
        deltas = self.take()
        if not deltas:
            return
        args: list[Any] = [MAX_METRIC_FIELDS]
        for key, value in deltas.items():
            args += [key, repr(float(value))]
        try:
            store.scripts.metrics(keys=[store.keys.metrics], args=args)
        except Exception as exc:
            logger.debug("metrics flush failed (%r); kept for the next one", exc)
            self.give_back(deltas)


#: The most fields the cluster's metrics hash grows to: new stage series beyond it are
#: counted under the stage "other" (stage names come from task code and may be dynamic).
MAX_METRIC_FIELDS = 4096

#: This process's buffer.
buffer = MetricsBuffer()


def count_lease_activity(lease: Any, *, ended: bool = False) -> None:
    """Count a lease's progress updates and finished stages since the last count.

    Called by the heartbeat each tick, and once more when the attempt ends (``ended``),
    which also closes the current stage.
    """
    version = lease.version
    if version != lease.counted_version:
        buffer.inc("owner_progress_update_total", version - lease.counted_version)
        lease.counted_version = version
    finished = lease.take_stage_log() if lease.stage_log else []
    if ended and lease.stage is not None:
        now = time.monotonic()
        finished.append((lease.stage, now - lease.stage_started))
        lease.stage_started = now
    for stage, seconds in finished:
        if stage is not None:
            buffer.observe("owner_stage_duration_seconds", seconds, stage=stage)


def read_totals(store: Any) -> Iterator[tuple[str, str, float]]:
    """The cluster totals as ``(field, labels, value)``, from the metrics hash."""
    for raw_key, raw_value in store.client.hgetall(store.keys.metrics).items():
        key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
        value = float(raw_value)
        name, _, rest = key.partition("|")
        yield name, rest, value
