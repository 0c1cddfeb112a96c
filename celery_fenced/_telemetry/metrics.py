"""The seed's metrics, counted in each process and aggregated in Redis for the whole cluster.

Counting is in memory (a dict under a lock, never on the ``progress()`` path: progress
updates are counted from the lease's version by the heartbeat). Each process flushes its
deltas with one script call: with its heartbeat tick, or right after a rare event (a
takeover, a refused write). ``celery fenced metrics --port N`` serves the totals to
Prometheus, so prefork children that come and go lose nothing.
"""

from __future__ import annotations

import logging
import math
import threading
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..conf import FencedConfig
from .names import NameMemo

if TYPE_CHECKING:
    from .._lease.store import LeaseStore

__all__ = [
    "BUCKETS",
    "COUNTERS",
    "DEFAULT_DUE_HORIZON_MS",
    "GAP_MIN",
    "GAP_RATIO",
    "GAUGES",
    "HISTOGRAMS",
    "KNOWN_LABELS",
    "MAX_GAP_FIELDS",
    "MAX_METRIC_FIELDS",
    "ClusterCollector",
    "MetricsBuffer",
    "gap_bucket",
    "gap_bucket_middle",
    "read_false_takeovers",
    "read_gaps",
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
    "owner_fencing_rejected_total": (
        "Writes refused because a newer token owned the task or wrote the row or key"
        " (results, fenced_set, fenced_update)."
    ),
    "owner_false_takeover_total": (
        "Takeovers whose old owner ran on past its stage's deadline and then tried to store a SUCCESS"
        " (deadline too tight), by stage and task."
    ),
    "owner_stream_idle_timeout_total": "Streams that went quiet for longer than their idle timeout.",
}

#: Gauges, read from the lease store at each scrape (not counted by the processes).
GAUGES: Mapping[str, str] = {
    "owner_abandoned_tasks": "Tasks abandoned after max_takeovers and not redriven (the dead letters).",
    "owner_live_leases": "Leases the reaper watches: held, or waiting for a worker or a retry.",
    "owner_due_leases": "Live leases held, or waiting past their eta: those an owner or a worker should act on now.",
}

#: ``owner_due_leases``'s horizon with the default settings.
DEFAULT_DUE_HORIZON_MS = FencedConfig.from_mapping({}).due_horizon_ms

#: Label values a counter is served with from the start, at 0 until counted: Prometheus's
#: ``increase()`` sees the first takeover of each cause only if its series existed before it.
KNOWN_LABELS: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "owner_takeover_total": {"cause": ("stalled", "gone", "unstarted")},
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


# Global memos (bounded): a series' name is the same in every process and every app.
_series_names: NameMemo[tuple[str, tuple[tuple[str, str], ...]]] = NameMemo(
    lambda key: f"{key[0]}|{_labels(dict(key[1]))}"
)


def _series(name: str, labels: Mapping[str, str]) -> str:
    """``"name|k=v,…"``, built once per name and labels (stage names repeat)."""
    key = (name, tuple(labels.items()))
    try:
        return _series_names.made[key]  # the hot path: a name seen before
    except KeyError:
        return _series_names(key)


_PROGRESS_UPDATES = _series("owner_progress_update_total", {})
_TASK_DURATION = _series("owner_task_total_duration_seconds", {})
_stage_series: NameMemo[str] = NameMemo(lambda stage: _series("owner_stage_duration_seconds", {"stage": stage}))
"""The ``owner_stage_duration_seconds`` series of a stage."""


class MetricsBuffer:
    """The metric deltas of one process, waiting for the next flush."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Drop every pending delta (a forked child's are its parent's, flushed by the parent)."""
        self._lock = threading.Lock()
        self._deltas: dict[str, float] = defaultdict(float)
        # Histograms: per series, the count of each bucket alone (made cumulative by take()),
        # so that an observation is one bisect and one increment.
        self._observed: dict[str, list[float]] = {}
        # Per task and stage, how many stage visits had their longest gap between progress
        # calls in each bucket of the fine gap histogram, since the last flush.
        self._gaps: dict[tuple[str, str], dict[int, int]] = defaultdict(lambda: defaultdict(int))

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
        with self._lock:
            self._observe(base, value)

    def _observe(self, base: str, value: float) -> None:
        """One observation of the histogram series ``base`` (the lock held)."""
        series = self._observed.get(base)
        if series is None:
            series = self._observed[base] = [0.0] * (len(BUCKETS) + 3)  # buckets, +Inf, sum, count
        series[bisect_left(BUCKETS, value)] += 1  # the first bucket whose bound is >= value
        series[-2] += value
        series[-1] += 1

    def count_activity(
        self,
        updates: int,
        stages: Sequence[tuple[str | None, float, float]],
        *,
        sample_gaps: bool,
        duration: float | None = None,
        task: str = "",
    ) -> None:
        """Count ``updates`` progress calls and the stages an attempt finished, in one step.

        ``stages`` holds ``(stage, seconds in it, longest gap between progress calls)``; the
        gaps are sampled for ``tune`` only when ``sample_gaps``, under ``task`` (the task's
        name: each task may have its own deadlines). ``duration`` is the run time of an
        attempt that stored its SUCCESS (``owner_task_total_duration_seconds``).
        """
        with self._lock:
            if updates:
                self._deltas[_PROGRESS_UPDATES] += updates
            for stage, seconds, gap in stages:
                if stage is not None:
                    self._observe(_stage_series(stage), seconds)
                    if sample_gaps:
                        self._gaps[task, stage][gap_bucket(gap)] += 1
            if duration is not None:
                self._observe(_TASK_DURATION, duration)

    def sample_gap(self, stage: str, seconds: float, task: str = "") -> None:
        """Record the longest gap between progress calls of one visit of ``stage`` by ``task``."""
        index = gap_bucket(seconds)
        with self._lock:
            self._gaps[task, stage][index] += 1

    def take_gaps(self) -> dict[tuple[str, str], dict[int, int]]:
        """Take the pending gap counts, per ``(task, stage)`` and bucket (they are gone from the buffer)."""
        with self._lock:
            gaps, self._gaps = self._gaps, defaultdict(lambda: defaultdict(int))
        return {key: dict(counts) for key, counts in gaps.items()}

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

    def flush(self, store: LeaseStore) -> None:
        """Add the pending deltas to the cluster totals (one script call); keep them on error.

        Gap counts, when there are any, go in a second call; they are dropped on error
        (they are samples: the next ones take their place).
        """
        gaps = self.take_gaps() if self._gaps else {}
        if gaps:
            counts = {
                f"{task}|{stage}|{index}": count
                for (task, stage), by_bucket in gaps.items()
                for index, count in by_bucket.items()
            }
            try:
                store.metrics.add_gaps(counts, max_fields=MAX_GAP_FIELDS)
            except Exception as exc:
                logger.debug("gap samples dropped (%r)", exc)
        deltas = self.take()
        if not deltas:
            return
        try:
            store.metrics.add_metrics(deltas, max_fields=MAX_METRIC_FIELDS)
        except Exception as exc:
            logger.debug("metrics flush failed (%r); kept for the next one", exc)
            self.give_back(deltas)


#: The most fields the cluster's metrics hash grows to: new stage series beyond it are
#: counted under the stage "other" (stage names come from task code and may be dynamic).
MAX_METRIC_FIELDS = 4096

#: The fine histogram of gaps: bucket ``i`` holds gaps in ``[GAP_MIN·R^i, GAP_MIN·R^(i+1))``
#: with ``R = GAP_RATIO``, so a quantile read from it is within 1 % of the sampled one
#: (its bucket's geometric middle). Gaps below ``GAP_MIN`` seconds fall in bucket 0.
GAP_MIN = 0.001
GAP_RATIO = 1.02
_LOG_RATIO = math.log(GAP_RATIO)

#: The most fields the gap histograms grow to (about 900 buckets span 1 ms to a day); new
#: stages beyond it are counted under the stage "other".
MAX_GAP_FIELDS = 65536


def gap_bucket(seconds: float) -> int:
    """The fine-histogram bucket of a gap of ``seconds``."""
    if seconds <= GAP_MIN:
        return 0
    return int(math.log(seconds / GAP_MIN) / _LOG_RATIO)


def gap_bucket_middle(index: int) -> float:
    """The geometric middle of bucket ``index``, seconds: what a quantile in it reads as."""
    return float(GAP_MIN * GAP_RATIO ** (index + 0.5))


def read_gaps(store: LeaseStore) -> dict[tuple[str, str], dict[int, int]]:
    """Per task and stage, the cluster's fine gap histogram: ``{(task, stage): {bucket: count}}``.

    A sample counted without its task (a version before samples named it) has the task ``""``.
    """
    gaps: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)
    for field, count in store.metrics.gap_fields().items():
        head, _, index = field.rpartition("|")
        task, named, stage = head.partition("|")
        key = (task, stage) if named else ("", head)
        gaps[key][int(index)] = gaps[key].get(int(index), 0) + count
    return dict(gaps)


def read_false_takeovers(store: LeaseStore) -> dict[tuple[str, str], float]:
    """The cluster's false takeovers, per ``(task, stage)`` (task ``""`` when not named)."""
    counts: dict[tuple[str, str], float] = defaultdict(float)
    for name, labels, value in read_totals(store):
        if name == "owner_false_takeover_total":
            parsed = _parse_labels(labels)
            counts[parsed.get("task", ""), parsed.get("stage", "")] += value
    return dict(counts)


def read_totals(store: LeaseStore) -> Iterator[tuple[str, str, float]]:
    """The cluster totals as ``(field, labels, value)``, from the metrics hash."""
    for field, value in store.metrics.metric_fields().items():
        name, _, rest = field.partition("|")
        yield name, rest, value


class ClusterCollector:
    """A Prometheus collector reading the cluster totals from Redis at each scrape."""

    def __init__(self, store: LeaseStore, due_within_ms: int = DEFAULT_DUE_HORIZON_MS) -> None:
        self.store = store
        #: ``owner_due_leases`` counts the leases due within this much (``FencedConfig.due_horizon_ms``).
        self.due_within_ms = due_within_ms

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        name = "owner_abandoned_tasks"
        yield GaugeMetricFamily(name, GAUGES[name], value=float(self.store.abandoned_count()))
        name = "owner_live_leases"
        yield GaugeMetricFamily(name, GAUGES[name], value=float(self.store.live_count()))
        name = "owner_due_leases"
        yield GaugeMetricFamily(name, GAUGES[name], value=float(self.store.due_count(self.due_within_ms)))

        counters: dict[str, dict[str, float]] = defaultdict(dict)
        histograms: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
        for name, rest, value in read_totals(self.store):
            if name in COUNTERS:
                counters[name][rest] = value
            elif name in HISTOGRAMS:
                labels, _, part = rest.partition("|")
                histograms[name][labels][part] = value
        for name, known in KNOWN_LABELS.items():
            for label, label_values in known.items():
                for label_value in label_values:
                    counters[name].setdefault(f"{label}={label_value}", 0.0)
        for name, help_text in COUNTERS.items():
            label_names = sorted({k for labels in counters[name] for k in _parse_labels(labels)})
            family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=label_names)
            if not counters[name] and not label_names:
                family.add_metric([], 0.0)
            for labels, value in counters[name].items():
                parsed = _parse_labels(labels)
                family.add_metric([parsed.get(k, "") for k in label_names], value)
            yield family
        for name, help_text in HISTOGRAMS.items():
            label_names = sorted({k for labels in histograms[name] for k in _parse_labels(labels)})
            histogram = HistogramMetricFamily(name, help_text, labels=label_names)
            for labels, parts in histograms[name].items():
                parsed = _parse_labels(labels)
                buckets = [(str(b), parts.get(f"bucket|{b}", 0.0)) for b in BUCKETS]
                buckets.append(("+Inf", parts.get("bucket|+Inf", 0.0)))
                histogram.add_metric([parsed.get(k, "") for k in label_names], buckets, parts.get("sum", 0.0))
            yield histogram


def _parse_labels(text: str) -> dict[str, str]:
    if not text:
        return {}
    return dict(pair.split("=", 1) for pair in text.split(","))
