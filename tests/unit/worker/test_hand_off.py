"""The owner's side of a hand-off (``Task.replace()``): a lease that is not the owner's any
more, vanished included, sends no replacement."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_fenced import LeaseLostError, ProgressLeasedTask
from celery_fenced._lease.state import LeaseStatus
from celery_fenced._task.owner import OwnedLease
from celery_fenced._worker.lifecycle import hand_off
from celery_fenced.conf import ensure_conf, forget_window

OWNER = "host/1/a"


def owned(app: Celery, task_name: str) -> OwnedLease:
    policy = ensure_conf(app).policy
    store = app.backend.lease_store
    result = store.acquire(
        "t1", OWNER, ttl_ms=policy.lease_ttl_ms, task_name=task_name, max_takeovers=3, publish_id="p1"
    )
    return OwnedLease("t1", task_name, OWNER, result.token, result.attempt, result.takeovers, policy, publish_id="p1")


def test_the_owner_hands_off_into_a_record(fenced_app: Celery) -> None:
    @fenced_app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def replaced(self: ProgressLeasedTask) -> None: ...

    lease = owned(fenced_app, replaced.name)
    hand_off(replaced, lease)
    record = fenced_app.backend.lease_store.read("t1")
    assert record is not None and record.status == LeaseStatus.HANDED_OFF
    assert record.raw["handoffToken"] == str(lease.token)


def test_a_vanished_lease_is_no_hand_off(fenced_app: Celery) -> None:
    @fenced_app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def replaced(self: ProgressLeasedTask) -> None: ...

    lease = owned(fenced_app, replaced.name)
    store = fenced_app.backend.lease_store
    store.client.delete(store.keys.lease("t1"))  # taken over and handed off by a newer owner, then lost
    with pytest.raises(LeaseLostError):
        hand_off(replaced, lease)  # Celery then sends nothing: the body ends as Ignore
    assert store.read("t1") is None


def test_the_record_outlives_a_short_result_expiry_by_the_forget_window(fenced_app: Celery) -> None:
    """A copy of the replaced message can arrive as late as the forget window (the broker's
    visibility timeout, the reaper's re-sends): the record refuses it until then."""

    @fenced_app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def replaced(self: ProgressLeasedTask) -> None: ...

    fenced_app.conf.result_expires = 30
    fenced_app.backend.expires = 30
    lease = owned(fenced_app, replaced.name)
    hand_off(replaced, lease)
    store = fenced_app.backend.lease_store
    assert store.client.pttl(store.keys.lease("t1")) > (forget_window(fenced_app) - 60) * 1000 > 30_000
