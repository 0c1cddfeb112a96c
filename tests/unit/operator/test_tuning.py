"""``tune``: what it samples (the longest gap between progress calls), and what it suggests.

Suggestions are checked against distributions whose quantiles are known exactly, through
the real path: the metrics buffer, the gap script on a real Redis, and
:func:`~celery_fenced._telemetry.metrics.read_gaps`.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest
import redis

from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.store import LeaseStore
from celery_fenced._operator.tuning import quantile, suggest
from celery_fenced._task.owner import OwnedLease
from celery_fenced._telemetry import metrics
from celery_fenced._telemetry.metrics import MetricsBuffer, gap_bucket, read_gaps
from celery_fenced._telemetry.process import TELEMETRY
from celery_fenced._worker.attempt import report_the_end
from celery_fenced.conf import FencedConfig

FLOOR, FACTOR = 0.1, 3.0


@pytest.fixture
def store(redis_client: redis.Redis) -> LeaseStore:
    return LeaseStore(redis_client, KeySpace.build("fenced", "celery-task-meta-"))


SAMPLES = 20_000


TASK = "proj.report"


def stored_samples(store: LeaseStore, stage: str, values: list[float]) -> dict[int, int]:
    """Flush ``values`` as gap samples of ``stage`` the way workers do, and read them back."""
    for start in range(0, len(values), 2500):  # several processes, several flushes
        buffer = MetricsBuffer()
        for value in values[start : start + 2500]:
            buffer.sample_gap(stage, value, task=TASK)
        buffer.flush(store)
    return read_gaps(store)[TASK, stage]


# Exact 99th percentiles: uniform(0, 2), lognormal(0, 0.5), exponential(mean 1).
Z99 = statistics.NormalDist().inv_cdf(0.99)
DISTRIBUTIONS = {
    "uniform": (lambda rng: rng.uniform(0, 2), 2 * 0.99),
    "lognormal": (lambda rng: rng.lognormvariate(0, 0.5), math.exp(0.5 * Z99)),
    "exponential": (lambda rng: rng.expovariate(1.0), -math.log(0.01)),
}


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_suggestions_follow_known_distributions_within_ten_percent(store: LeaseStore, name: str) -> None:
    draw, p99 = DISTRIBUTIONS[name]
    rng = random.Random(7)
    histogram = stored_samples(store, "call-ai", [draw(rng) for _ in range(SAMPLES)])
    assert len(histogram) < 1000  # buckets, not samples: bounded whatever the count
    key = (TASK, "call-ai")
    [suggestion] = suggest({key: histogram}, {}, {key: 60.0}, floor=FLOOR, factor=FACTOR)
    assert suggestion.samples == SAMPLES and suggestion.enough
    assert suggestion.gap_quantile == pytest.approx(p99, rel=0.10)
    assert suggestion.suggested == pytest.approx(p99 * FACTOR, rel=0.10)


def test_new_stages_past_the_bound_are_counted_under_other(store: LeaseStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "MAX_GAP_FIELDS", 2)
    for stage in ("a", "b", "c", "a"):
        buffer = MetricsBuffer()
        buffer.sample_gap(stage, 1.0, task=TASK)
        buffer.flush(store)
    one = {gap_bucket(1.0): 1}
    assert read_gaps(store) == {(TASK, "a"): {gap_bucket(1.0): 2}, (TASK, "b"): one, (TASK, "other"): one}


def test_samples_are_kept_per_task_and_older_ones_that_name_none_still_read(store: LeaseStore) -> None:
    buffer = MetricsBuffer()
    buffer.sample_gap("call-ai", 1.0, task="proj.a")
    buffer.sample_gap("call-ai", 2.0, task="proj.b")
    buffer.flush(store)
    store.metrics.add_gaps({f"call-ai|{gap_bucket(3.0)}": 4}, max_fields=1000)  # counted before samples named tasks
    assert read_gaps(store) == {
        ("proj.a", "call-ai"): {gap_bucket(1.0): 1},
        ("proj.b", "call-ai"): {gap_bucket(2.0): 1},
        ("", "call-ai"): {gap_bucket(3.0): 4},
    }


def test_a_sample_is_the_longest_gap_between_progress_calls_not_the_time_in_the_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr("celery_fenced._task.owner._monotonic", lambda: clock[0])
    buffer = MetricsBuffer()
    monkeypatch.setattr(TELEMETRY, "metrics", buffer)
    policy = FencedConfig.from_mapping({}).policy
    lease = OwnedLease("t1", "proj.task", "host/1/a", 1, 1, 0, policy, started=100.0)
    lease.progress("load-data")
    for gap in (1.0, 4.0, 2.0, 1.0):  # 8 s in the stage, at most 4 s without progress
        clock[0] += gap
        lease.progress("load-data")
    clock[0] += 0.5
    lease.progress("call-ai")
    clock[0] += 3.0  # the last stage's final gap, up to the end of the attempt
    activity = lease.stop_serving()
    assert activity is not None
    report_the_end(None, lease, activity)
    gaps = buffer.take_gaps()
    assert gaps == {("proj.task", "load-data"): {gap_bucket(4.0): 1}, ("proj.task", "call-ai"): {gap_bucket(3.0): 1}}
    deltas = buffer.take()
    assert deltas["owner_stage_duration_seconds|stage=load-data|sum"] == pytest.approx(8.5)


def test_a_lost_owner_gives_no_sample_of_its_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = MetricsBuffer()
    monkeypatch.setattr(TELEMETRY, "metrics", buffer)
    policy = FencedConfig.from_mapping({}).policy
    lease = OwnedLease("t1", "proj.task", "host/1/a", 1, 1, 0, policy)
    lease.progress("load-data")
    lease.mark_lost("taken over")
    activity = lease.end()  # its late result landed: a lost owner's end
    assert activity is not None and activity[2] is False  # not a sample of what the stage needs
    report_the_end(None, lease, activity)
    assert buffer.take_gaps() == {}


def test_false_takeovers_forbid_a_cut() -> None:
    load, call = (TASK, "load-data"), (TASK, "call-ai")
    gaps = {load: {gap_bucket(0.2): 100}, call: {gap_bucket(0.2): 100}}
    current = {load: 4.0, call: 4.0}
    by_stage = {s.stage: s for s in suggest(gaps, {load: 1}, current, floor=1.0, factor=FACTOR)}
    assert by_stage["call-ai"].suggested == 1.0  # cut to the floor: nothing says it was too tight
    assert by_stage["load-data"].suggested == 4.0 and by_stage["load-data"].false_takeovers == 1
    assert "not cut" in by_stage["load-data"].note
    persist = (TASK, "persist")
    [only_false] = suggest({}, {persist: 2}, {persist: 5.0}, floor=1.0, factor=FACTOR)
    assert only_false.suggested == 5.0 and only_false.samples == 0


def test_few_samples_are_said_so() -> None:
    key = (TASK, "load-data")
    [one] = suggest({key: {gap_bucket(0.5): 1}}, {}, {key: 60.0}, floor=FLOOR, factor=FACTOR, min_samples=30)
    assert one.samples == 1 and not one.enough and one.note == "only 1 sample(s)"


def test_quantile_is_nearest_rank_within_a_percent() -> None:
    histogram: dict[int, int] = {}
    for value in range(1, 101):
        histogram[gap_bucket(float(value))] = histogram.get(gap_bucket(float(value)), 0) + 1
    assert quantile(histogram, 0.99) == pytest.approx(99.0, rel=0.01)
    assert quantile(histogram, 1.0) == pytest.approx(100.0, rel=0.01)
    assert quantile(histogram, 0.5) == pytest.approx(50.0, rel=0.01)
    assert quantile({gap_bucket(3.0): 1}, 0.99) == pytest.approx(3.0, rel=0.01)
    with pytest.raises(ValueError):
        quantile({}, 0.99)
