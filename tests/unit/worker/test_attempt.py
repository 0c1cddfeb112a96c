"""The attempt object: what each result write's outcome does to the owner's lease."""

from __future__ import annotations

import time

import pytest
import redis
from celery import Celery
from celery.app.task import Context

from celery_fenced._backend.fence import SKIPPED, fence_of
from celery_fenced._backend.writes import WriteReport
from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.state import StoreOutcome, StoreResult
from celery_fenced._lease.store import LeaseStore
from celery_fenced._task.owner import OwnedLease
from celery_fenced._task.running import ATTEMPT_ATTRIBUTE, began
from celery_fenced._telemetry.metrics import MetricsBuffer
from celery_fenced._telemetry.process import TELEMETRY
from celery_fenced._worker.attempt import (
    Attempt,
    attempt_of,
    begin,
    false_takeover,
    fence_for,
    overtaken_by_its_retry,
    skip,
)
from celery_fenced._worker.heartbeat import Heartbeat
from celery_fenced.conf import FencedConfig, ensure_conf

OWNER = "host/1/a"


@pytest.fixture
def store(redis_client: redis.Redis) -> LeaseStore:
    return LeaseStore(redis_client, KeySpace.build("fenced", "celery-task-meta-"))


@pytest.fixture
def buffer(monkeypatch: pytest.MonkeyPatch) -> MetricsBuffer:
    fresh = MetricsBuffer()
    monkeypatch.setattr(TELEMETRY, "metrics", fresh)
    return fresh


@pytest.fixture
def app() -> Celery:
    return Celery("attempts", set_as_current=False)  # events off: nothing is sent


def held(store: LeaseStore, task_id: str = "t1") -> OwnedLease:
    policy = FencedConfig.from_mapping({"fenced_default_stage_timeout": 5}).policy
    state = store.acquire(task_id, OWNER, ttl_ms=policy.lease_ttl_ms, task_name="proj.task", max_takeovers=3).state
    return OwnedLease(task_id, "proj.task", OWNER, state.owner_token, state.attempt, state.takeovers, policy)


def written(attempt: Attempt, state: str, outcome: StoreResult) -> WriteReport:
    """The report of a write the attempt made for its own task."""
    assert attempt.lease is not None
    request = Context(id=attempt.lease.task_id, **{ATTEMPT_ATTRIBUTE: attempt})
    return WriteReport(attempt.lease.task_id, state, attempt.lease.token, outcome, request)


def test_the_attempt_rides_on_its_request_and_nowhere_else() -> None:
    request = Context(id="t1")
    assert attempt_of(request) is None and not began(request)
    attempt = begin(request)
    assert attempt_of(request) is attempt and attempt.lease is None and began(request)
    assert fence_of(request) is None  # no lease: its writes carry no token
    assert attempt_of(None) is None


def test_the_request_of_a_leased_attempt_carries_its_fence_as_plain_data(store: LeaseStore) -> None:
    lease = held(store)
    lease.publish_id = "pub1"
    request = Context(id="t1")
    begin(request, lease)
    fence = fence_of(request)
    assert fence == fence_for(lease)
    assert fence is not None and (fence.task_id, fence.token, fence.owner_id) == ("t1", lease.token, OWNER)
    assert (fence.publish_id, fence.attempt, fence.takeovers) == ("pub1", lease.attempt, lease.takeovers)
    assert not fence.skipped and not fence.result_stored and fence.retry_delay == 0.0


def test_a_skipped_delivery_drops_its_writes() -> None:
    request = Context(id="t1")
    attempt = begin(request)
    skip(request, attempt, "duplicate")
    assert attempt.skip == "duplicate" and fence_of(request) is SKIPPED and SKIPPED.skipped


def test_a_stored_ready_state_ends_the_lease_and_counts_the_attempt(
    store: LeaseStore, buffer: MetricsBuffer, app: Celery
) -> None:
    lease = held(store)
    lease.progress("load")
    attempt = Attempt(lease=lease)
    attempt.result_written(store, app, written(attempt, "SUCCESS", StoreResult(StoreOutcome.STORED, "DONE")))
    assert attempt.write == "stored" and lease.ended and lease.lost_reason is None
    totals = buffer.take()
    assert totals["owner_progress_update_total|"] == 1
    assert totals["owner_task_total_duration_seconds||count"] == 1
    assert totals["owner_stage_duration_seconds|stage=load|count"] == 1


def test_a_stored_started_state_leaves_the_lease_running(store: LeaseStore, buffer: MetricsBuffer, app: Celery) -> None:
    lease = held(store)
    attempt = Attempt(lease=lease)
    attempt.result_written(store, app, written(attempt, "STARTED", StoreResult(StoreOutcome.STORED, "RUNNING")))
    assert not lease.ended and buffer.take() == {}


def test_a_stale_success_soon_after_a_takeover_loses_the_lease_and_is_a_false_takeover(
    store: LeaseStore, buffer: MetricsBuffer, app: Celery
) -> None:
    lease = held(store)
    lease.progress("call-ai")
    lease.body.last_progress = time.monotonic() - 8  # it ran on 8 s past its last progress (5 s deadline)
    store.lapse("t1", OWNER, lease.token, mode="release")
    assert store.claim_due(["t1"], grace_ms=0, requeue_ms=60_000, abandoned_meta=lambda *_: b"", expires_ms=0)
    attempt = Attempt(lease=lease)
    attempt.result_written(
        store, app, written(attempt, "SUCCESS", StoreResult(StoreOutcome.STALE, str(lease.token + 1)))
    )
    assert lease.lost_reason == "fenced: a newer token owns the task"
    counted = dict(store.metrics.metric_fields())  # flushed with the loss
    assert counted["owner_false_takeover_total|stage=call-ai,task=proj.task"] == 1


def test_a_takeover_is_false_only_when_the_owner_ran_on_past_its_deadline() -> None:
    # (deadline, seconds from its last progress to its SUCCESS, of them with the process silent)
    assert false_takeover(5, 8, 0)  # it ran 8 s on a 5 s deadline, then finished: too tight
    assert false_takeover(120, 200, 30)  # 170 s of work on a 120 s deadline, a pause besides
    assert not false_takeover(120, 40, 35)  # frozen (SIGSTOP) 35 s: its lease expired, rightly
    assert not false_takeover(5, 48, 45)  # frozen past its deadline: the takeover was right
    assert not false_takeover(5, 3, 0)  # lost within its deadline (Redis out of reach): not the deadline
    assert not false_takeover(5, 60, 0)  # 12 deadlines: stuck, not slow


class FrozenFor:
    """A heartbeat whose process did not run for the last ``seconds`` (SIGSTOP, then SIGCONT)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def silent_between(self, start: float, end: float) -> float:
        return max(0.0, min(self.seconds, end - start))


def test_a_frozen_owners_late_success_is_no_false_takeover(
    store: LeaseStore, buffer: MetricsBuffer, app: Celery
) -> None:
    lease = held(store)
    lease.progress("call-ai")
    lease.body.last_progress = time.monotonic() - 40  # 40 s without progress, 38 s of them frozen
    store.lapse("t1", OWNER, lease.token, mode="release")
    assert store.claim_due(["t1"], grace_ms=0, requeue_ms=60_000, abandoned_meta=lambda *_: b"", expires_ms=0)
    attempt = Attempt(lease=lease, heartbeat=FrozenFor(38))  # type: ignore[arg-type]
    attempt.result_written(store, app, written(attempt, "SUCCESS", StoreResult(StoreOutcome.STALE, "99")))
    assert lease.lost_reason is not None
    assert not any(field.startswith("owner_false_takeover_total") for field in store.metrics.metric_fields())


def test_a_slow_owner_whose_heartbeat_never_fell_silent_is_a_false_takeover(
    store: LeaseStore, buffer: MetricsBuffer, app: Celery
) -> None:
    lease = held(store)
    lease.progress("call-ai")
    lease.body.last_progress = time.monotonic() - 40  # 40 s on a 5 s deadline: 8 deadlines
    store.lapse("t1", OWNER, lease.token, mode="release")
    assert store.claim_due(["t1"], grace_ms=0, requeue_ms=60_000, abandoned_meta=lambda *_: b"", expires_ms=0)
    beat = Heartbeat(store_factory=lambda: store, listener=None, default_interval=5)  # type: ignore[arg-type]
    attempt = Attempt(lease=lease, heartbeat=beat)
    attempt.result_written(store, app, written(attempt, "SUCCESS", StoreResult(StoreOutcome.STALE, "99")))
    assert dict(store.metrics.metric_fields())["owner_false_takeover_total|stage=call-ai,task=proj.task"] == 1


def test_a_stale_success_long_after_its_deadline_is_no_false_takeover(
    store: LeaseStore, buffer: MetricsBuffer, app: Celery
) -> None:
    lease = held(store)
    lease.body.last_progress = time.monotonic() - 60  # 12 times its 5 s deadline
    store.lapse("t1", OWNER, lease.token, mode="release")
    store.claim_due(["t1"], grace_ms=0, requeue_ms=60_000, abandoned_meta=lambda *_: b"", expires_ms=0)
    attempt = Attempt(lease=lease)
    attempt.result_written(store, app, written(attempt, "SUCCESS", StoreResult(StoreOutcome.STALE, "99")))
    assert lease.lost_reason is not None
    assert not any(field.startswith("owner_false_takeover_total") for field in store.metrics.metric_fields())


def test_a_retry_write_beaten_by_its_own_retry_message_loses_nothing(store: LeaseStore, app: Celery) -> None:
    lease = held(store)
    lease.mark_retrying()  # retry() moved the lease to RETRYING before sending the message
    attempt = Attempt(lease=lease)
    stale = StoreResult(StoreOutcome.STALE, str(lease.token + 1))
    assert overtaken_by_its_retry(written(attempt, "RETRY", stale), lease)
    assert not overtaken_by_its_retry(written(attempt, "SUCCESS", stale), lease)
    attempt.result_written(store, app, written(attempt, "RETRY", stale))
    assert lease.lost_reason is None


# -- a write whose lease the store lost (FLUSHDB, a restart without persistence, an eviction) -----


def _owned_write(fenced_app: Celery, started: float | None = None) -> tuple[OwnedLease, Context]:
    from celery_fenced._backend.writes import set_hook
    from celery_fenced._worker.attempt import after_write

    set_hook(fenced_app, after_write)  # the worker's write hook, as a worker installs it
    policy = ensure_conf(fenced_app).policy
    store = fenced_app.backend.lease_store
    result = store.acquire("t1", OWNER, ttl_ms=policy.lease_ttl_ms, task_name="proj.task", max_takeovers=3)
    lease = OwnedLease("t1", "proj.task", OWNER, result.token, 1, 0, policy, started=started)
    request = Context(id="t1")
    begin(request, lease)
    store.client.flushdb()  # the lease store loses everything
    return lease, request


def test_a_live_owners_write_whose_lease_vanished_gets_the_lease_back_and_is_stored(fenced_app: Celery) -> None:
    lease, request = _owned_write(fenced_app)
    fenced_app.backend.store_result("t1", "mine", "SUCCESS", request=request)
    assert attempt_of(request).write == StoreOutcome.STORED  # type: ignore[union-attr]
    assert fenced_app.AsyncResult("t1").result == "mine"
    assert lease.ended and lease.lost_reason is None


def test_a_thawed_owners_write_whose_lease_vanished_is_not_stored(fenced_app: Celery) -> None:
    # Its last renewal a TTL ago or more (frozen): a newer owner may hold the task, its lease
    # gone with this one's. Nothing is stored; the lease is written back given up, due a TTL
    # later, for the reaper (a live newer owner writes its own back over it first).
    policy = ensure_conf(fenced_app).policy
    lease, request = _owned_write(fenced_app, started=time.monotonic() - policy.lease_ttl - 1)
    fenced_app.backend.store_result("t1", "stale", "SUCCESS", request=request)
    assert attempt_of(request).write == "missing"  # type: ignore[union-attr]
    store = fenced_app.backend.lease_store
    assert store.client.get(store.keys.result("t1")) is None
    assert lease.lost_reason is not None
    written = store.read("t1")
    assert written is not None and written.status == "LAPSED" and written.owner_token == lease.token
    assert (written.lease_expire_at or 0) > store.server_time_ms() + policy.lease_ttl_ms // 2
