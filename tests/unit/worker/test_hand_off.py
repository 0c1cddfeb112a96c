"""The owner's side of a hand-off (``Task.replace()``): a lease that is not the owner's any
more sends no replacement; one that vanished is written back first, as the heartbeat would,
and handed off only if nobody else can have held it since."""

from __future__ import annotations

import time

import pytest
from celery import Celery

from celery_fenced import LeaseLostError, ProgressLeasedTask
from celery_fenced._lease.state import LeaseStatus
from celery_fenced._task.owner import OwnedLease
from celery_fenced._worker.lifecycle import hand_off
from celery_fenced.conf import ensure_conf, forget_window

OWNER = "host/1/a"


def owned(app: Celery, task_name: str, started: float | None = None) -> OwnedLease:
    policy = ensure_conf(app).policy
    store = app.backend.lease_store
    result = store.acquire(
        "t1", OWNER, ttl_ms=policy.lease_ttl_ms, task_name=task_name, max_takeovers=3, publish_id="p1"
    )
    return OwnedLease(
        "t1",
        task_name,
        OWNER,
        result.token,
        result.attempt,
        result.takeovers,
        policy,
        publish_id="p1",
        started=started,
    )


def test_the_owner_hands_off_into_a_record(fenced_app: Celery) -> None:
    @fenced_app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def replaced(self: ProgressLeasedTask) -> None: ...

    lease = owned(fenced_app, replaced.name)
    hand_off(replaced, lease)
    record = fenced_app.backend.lease_store.read("t1")
    assert record is not None and record.status == LeaseStatus.HANDED_OFF
    assert record.raw["handoffToken"] == str(lease.token)


def test_a_lease_that_vanished_while_its_owner_held_it_is_written_back_and_handed_off(fenced_app: Celery) -> None:
    # Its last renewal is less than a TTL ago: nobody else can have been given the task.
    @fenced_app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def replaced(self: ProgressLeasedTask) -> None: ...

    lease = owned(fenced_app, replaced.name)
    store = fenced_app.backend.lease_store
    store.client.delete(store.keys.lease("t1"))  # an eviction, a FLUSH, a failover that lost writes
    hand_off(replaced, lease)
    record = store.read("t1")
    assert record is not None and record.status == LeaseStatus.HANDED_OFF
    assert record.raw["handoffToken"] == str(lease.token)


def test_a_vanished_lease_its_owner_may_have_lost_is_no_hand_off_and_is_given_up(fenced_app: Celery) -> None:
    # Its last renewal a TTL ago or more: a newer owner may have taken the task over, handed it
    # off or finished it, and its record vanished with the lease.
    @fenced_app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def replaced(self: ProgressLeasedTask) -> None: ...

    policy = ensure_conf(fenced_app).policy
    lease = owned(fenced_app, replaced.name, started=time.monotonic() - policy.lease_ttl - 1)
    store = fenced_app.backend.lease_store
    store.client.delete(store.keys.lease("t1"))
    with pytest.raises(LeaseLostError):
        hand_off(replaced, lease)  # Celery then sends nothing: the body ends as Ignore
    record = store.read("t1")  # written back given up: the reaper re-sends the task
    assert record is not None and record.status == LeaseStatus.LAPSED and record.owner_token == lease.token


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
