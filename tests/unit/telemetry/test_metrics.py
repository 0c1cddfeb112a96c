"""The in-process metrics buffer: what a flush hands to Redis."""

from __future__ import annotations

import pytest
import redis

from celery_fenced._telemetry.metrics import MetricsBuffer

SERIES = "owner_stage_duration_seconds|stage=LOAD"


def test_histogram_buckets_are_cumulative_as_prometheus_reads_them() -> None:
    buffer = MetricsBuffer()
    for value in (0.003, 0.005, 0.7, 1000.0):
        buffer.observe("owner_stage_duration_seconds", value, stage="LOAD")
    deltas = buffer.take()
    assert deltas[f"{SERIES}|bucket|0.005"] == 2  # 0.005 itself falls in "le 0.005"
    assert deltas[f"{SERIES}|bucket|0.5"] == 2
    assert deltas[f"{SERIES}|bucket|1.0"] == 3
    assert deltas[f"{SERIES}|bucket|600.0"] == 3
    assert deltas[f"{SERIES}|bucket|+Inf"] == 4
    assert deltas[f"{SERIES}|count"] == 4
    assert deltas[f"{SERIES}|sum"] == pytest.approx(1000.708)
    assert buffer.take() == {}  # taken once


def test_taken_deltas_given_back_after_a_failed_flush_are_kept() -> None:
    buffer = MetricsBuffer()
    buffer.observe("owner_task_total_duration_seconds", 0.2)
    buffer.inc("owner_takeover_total", cause="gone")
    first = buffer.take()
    buffer.give_back(first)
    buffer.observe("owner_task_total_duration_seconds", 0.2)
    second = buffer.take()
    assert second["owner_task_total_duration_seconds||count"] == 2
    assert second["owner_task_total_duration_seconds||bucket|0.25"] == 2
    assert second["owner_takeover_total|cause=gone"] == 1


def test_an_attempts_activity_counts_as_the_separate_calls_would() -> None:
    """One call at the end of an attempt: its progress calls, the stages it finished (their
    gaps sampled), and its run time."""
    together, apart = MetricsBuffer(), MetricsBuffer()
    stages = [("LOAD", 0.7, 0.3), (None, 0.01, 0.01), ("SAVE", 0.02, 0.02)]
    together.count_activity(5, stages, sample_gaps=True, duration=0.75)
    apart.inc("owner_progress_update_total", 5)
    for stage, seconds, gap in stages:
        if stage is not None:
            apart.observe("owner_stage_duration_seconds", seconds, stage=stage)
            apart.sample_gap(stage, gap)
    apart.observe("owner_task_total_duration_seconds", 0.75)
    assert together.take_gaps() == apart.take_gaps() != {}
    taken = together.take()
    assert taken == apart.take()
    assert taken["owner_progress_update_total|"] == 5
    assert taken["owner_task_total_duration_seconds||count"] == 1
    assert taken["owner_stage_duration_seconds|stage=LOAD|count"] == 1


def test_unknown_names_are_refused() -> None:
    buffer = MetricsBuffer()
    with pytest.raises(KeyError, match="unknown histogram"):
        buffer.observe("owner_nope_seconds", 1.0)
    with pytest.raises(KeyError, match="unknown counter"):
        buffer.inc("owner_nope_total")


def test_new_stage_series_past_the_bound_are_counted_under_other(
    redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_fenced._lease.keys import KeySpace
    from celery_fenced._lease.store import LeaseStore
    from celery_fenced._telemetry import metrics

    store = LeaseStore(redis_client, KeySpace.build("fenced", "celery-task-meta-"))
    monkeypatch.setattr(metrics, "MAX_METRIC_FIELDS", 20)
    buffer = MetricsBuffer()
    for stage in ("known", "dynamic-1", "dynamic-2", "dynamic-3"):
        buffer.observe("owner_stage_duration_seconds", 0.1, stage=stage)
        buffer.flush(store)
    buffer.observe("owner_stage_duration_seconds", 0.1, stage="known")  # an existing series still counts
    buffer.flush(store)
    fields = {k.decode() for k in redis_client.hkeys(store.keys.metrics)}
    stages = {f.split("stage=", 1)[1].split("|", 1)[0] for f in fields}
    assert stages == {"known", "dynamic-1", "other"}  # about 18 fields a stage: the third is past 20
    known = redis_client.hget(store.keys.metrics, "owner_stage_duration_seconds|stage=known|count")
    other = redis_client.hget(store.keys.metrics, "owner_stage_duration_seconds|stage=other|count")
    assert float(known) == 2 and float(other) == 2  # type: ignore[arg-type]


def test_the_exporter_serves_every_takeover_cause_from_zero_and_the_live_and_due_leases(
    redis_client: redis.Redis,
) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from celery_fenced._lease.keys import KeySpace
    from celery_fenced._lease.store import LeaseStore
    from celery_fenced._telemetry.metrics import ClusterCollector

    store = LeaseStore(redis_client, KeySpace.build("fenced", "celery-task-meta-"))
    registry = CollectorRegistry()
    registry.register(ClusterCollector(store))
    text = generate_latest(registry).decode()
    for cause in ("stalled", "gone", "unstarted"):
        assert f'owner_takeover_total{{cause="{cause}"}} 0.0' in text
    assert "owner_live_leases 0.0" in text

    counted = MetricsBuffer()
    counted.inc("owner_takeover_total", cause="gone")
    counted.flush(store)
    # Two leases due long ago, one whose retry is due in ten hours: live, not due.
    later = store.server_time_ms() + 10 * 3600 * 1000
    redis_client.zadd(store.keys.index, {store.keys.lease("t1"): 1, store.keys.lease("t2"): 2})
    redis_client.zadd(store.keys.index, {store.keys.lease("t3"): later})
    text = generate_latest(registry).decode()
    assert 'owner_takeover_total{cause="gone"} 1.0' in text
    assert 'owner_takeover_total{cause="stalled"} 0.0' in text
    assert "owner_live_leases 3.0" in text
    assert "owner_due_leases 2.0" in text


def test_a_lease_counts_as_due_within_the_longest_of_the_lease_and_the_timeouts() -> None:
    from celery_fenced._telemetry.metrics import DEFAULT_DUE_HORIZON_MS
    from celery_fenced.conf import FencedConfig

    assert FencedConfig.from_mapping({}).due_horizon_ms == DEFAULT_DUE_HORIZON_MS == 60_000
    assert FencedConfig.from_mapping({"fenced_requeue_timeout": 120}).due_horizon_ms == 120_000
    assert (
        FencedConfig.from_mapping({"fenced_lease_ttl": 300, "fenced_heartbeat_interval": 5}).due_horizon_ms == 300_000
    )
