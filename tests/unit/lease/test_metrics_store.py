"""The cluster's metrics in Redis: each process's deltas add up, and the hashes stay bounded."""

from __future__ import annotations

import pytest
import redis

from celery_fenced._lease.gateway import ScriptSet
from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.metrics_store import MetricsStore


@pytest.fixture
def totals(redis_client: redis.Redis) -> MetricsStore:
    return MetricsStore(redis_client, ScriptSet(redis_client), KeySpace.build("fenced", "celery-task-meta-"))


def test_the_deltas_of_every_process_add_up(totals: MetricsStore) -> None:
    totals.add_metrics({"owner_heartbeat_total|": 3, "owner_renew_seconds|stage=a|sum": 0.25}, max_fields=100)
    totals.add_metrics({"owner_heartbeat_total|": 2}, max_fields=100)
    assert totals.metric_fields() == {"owner_heartbeat_total|": 5.0, "owner_renew_seconds|stage=a|sum": 0.25}


def test_a_new_stage_past_the_bound_is_counted_as_other(totals: MetricsStore) -> None:
    totals.add_metrics({"owner_stalls_total|stage=a": 1}, max_fields=1)
    totals.add_metrics({"owner_stalls_total|stage=b": 1, "owner_stalls_total|stage=a": 1}, max_fields=1)
    assert totals.metric_fields() == {"owner_stalls_total|stage=a": 2.0, "owner_stalls_total|stage=other": 1.0}


def test_gap_samples_add_up_per_stage_and_bucket(totals: MetricsStore) -> None:
    totals.add_gaps({"load|12": 2, "call|40": 1}, max_fields=100)
    totals.add_gaps({"load|12": 3}, max_fields=100)
    assert totals.gap_fields() == {"load|12": 5, "call|40": 1}
