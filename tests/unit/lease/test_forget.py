"""``AsyncResult.forget()`` (forget.lua): the result goes, the fact that the task is done stays.

Each test fails where forget deleted the result key alone: a finished task's lease lived only
in its result, so a late copy of its message was a first delivery and ran again.
"""

from __future__ import annotations

import json

import pytest
import redis

from celery_fenced._lease.finished import FENCE_RUN
from celery_fenced._lease.state import AcquireOutcome, ForgetOutcome, LeaseStatus, Reservation
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import acquire, held

A, B = "host/1/a", "host/2/b"
CALL = {"task": "proj.task", "args": [1], "kwargs": {}, "options": {"queue": "celery"}}


def finished(store: LeaseStore) -> int:
    """A task run and finished under publish p1, its fence in its result: its token."""
    state = held(store, owner=A, call=CALL, publish_id="p1")
    token = state.owner_token
    value = json.dumps({"status": "SUCCESS", "result": 1, "task_id": "t1", FENCE_RUN: "p1/1/0", "fence_token": token})
    assert store.store("t1", token, value.encode(), state="SUCCESS", kind="ready", expires_ms=0, owner_id=A).stored
    return token


def test_forget_leaves_a_done_tombstone_that_refuses_a_late_copy(store: LeaseStore, redis_client: redis.Redis) -> None:
    token = finished(store)
    assert not redis_client.exists(store.keys.lease("t1"))  # the common path: no hash
    assert store.forget("t1", keep_ms=60_000) == ForgetOutcome.FORGOTTEN
    assert not redis_client.exists(store.keys.result("t1"))
    tombstone = store.read("t1")
    assert tombstone is not None and tombstone.status == LeaseStatus.DONE
    assert (tombstone.owner_token, tombstone.attempt, tombstone.raw["publishId"]) == (token, 1, "p1")
    assert tombstone.raw["resultState"] == "SUCCESS" and "forgottenAt" in tombstone.raw
    assert 0 < redis_client.pttl(store.keys.lease("t1")) <= 60_000

    late = acquire(store, owner=B, call=CALL, publish_id="p1")
    assert late.outcome == AcquireOutcome.DONE and not late.outcome.runs
    assert store.reserve_many([Reservation("t1", 5000, "proj.task", CALL, 3, publish_id="p1")], "w1@host") == ["left"]
    zombie = store.store("t1", token - 1 if token > 1 else 1, b"{}", state="SUCCESS", kind="ready", expires_ms=0)
    assert zombie.code in ("stale", "finished") and not redis_client.exists(store.keys.result("t1"))
    # The task id applied again is a new run, as Celery allows.
    assert acquire(store, owner=B, call=CALL, publish_id="p2").outcome == AcquireOutcome.NEW


def test_forget_of_a_tombstone_keeps_it_for_the_window(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = held(store, owner=A, call=CALL, publish_id="p1")
    assert store.release("t1", A, state.owner_token, status=LeaseStatus.DONE) == "ok"  # no expiry
    redis_client.set(store.keys.result("t1"), b'{"status": "SUCCESS"}')
    assert store.forget("t1", keep_ms=60_000) == ForgetOutcome.FORGOTTEN
    assert not redis_client.exists(store.keys.result("t1"))
    assert 0 < redis_client.pttl(store.keys.lease("t1")) <= 60_000
    assert acquire(store, owner=B, call=CALL, publish_id="p1").outcome == AcquireOutcome.DONE


def test_forget_of_a_running_task_leaves_its_lease(store: LeaseStore, redis_client: redis.Redis) -> None:
    held(store, owner=A, call=CALL, publish_id="p1")
    redis_client.set(store.keys.result("t1"), b'{"status": "STARTED"}')
    assert store.forget("t1", keep_ms=60_000) == ForgetOutcome.DELETED
    assert not redis_client.exists(store.keys.result("t1"))
    lease = store.read("t1")
    assert lease is not None and lease.status == LeaseStatus.RUNNING
    assert redis_client.pttl(store.keys.lease("t1")) == -1


def test_forget_of_a_plain_result_deletes_it(store: LeaseStore, redis_client: redis.Redis) -> None:
    redis_client.set(store.keys.result("t1"), b'{"status": "SUCCESS", "result": 1}')
    assert store.forget("t1", keep_ms=60_000) == ForgetOutcome.DELETED
    assert not redis_client.exists(store.keys.result("t1")) and not redis_client.exists(store.keys.lease("t1"))
    with pytest.raises(ValueError):
        store.forget("t1", keep_ms=0)
