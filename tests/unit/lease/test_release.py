"""release.lua: the end of a lease no result write ended; the hand-off to a replacement."""

from __future__ import annotations

import json

import pytest
import redis

from celery_fenced._lease.state import LeaseStatus
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import acquire, held, server_ms, wait_for


def test_release_done_expires_with_the_result(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = held(store)
    assert store.release("t1", "host/1/a", state.owner_token, status=LeaseStatus.DONE, keep_ms=60_000) == "ok"
    after = store.read("t1")
    assert after is not None and after.status == "DONE"
    assert 0 < redis_client.pttl(store.keys.lease("t1")) <= 60_000
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) is None
    assert store.release("t1", "host/1/a", state.owner_token, status=LeaseStatus.DONE) == "finished"


@pytest.mark.parametrize("status", [LeaseStatus.RETRYING, LeaseStatus.REQUEUED])
def test_release_to_retrying_or_requeued_sets_the_due_time(
    store: LeaseStore, redis_client: redis.Redis, status: LeaseStatus
) -> None:
    state = held(store)
    assert store.release("t1", "host/1/a", state.owner_token, status=status, due_in_ms=5000) == "ok"
    after = store.read("t1")
    now = server_ms(redis_client)
    assert after is not None and after.status == status.value
    assert after.lease_expire_at is not None and now + 3000 < after.lease_expire_at <= now + 5000
    with pytest.raises(ValueError):
        store.release("t1", "host/1/a", state.owner_token, status=LeaseStatus.RUNNING)


def test_a_retry_records_its_own_call_for_the_reaper(store: LeaseStore, redis_client: redis.Redis) -> None:
    before = {"task": "proj.task", "args": [1], "kwargs": {}, "options": {"retries": 0}}
    state = held(store, call=before)
    key = store.keys.lease("t1")
    retry = {**before, "args": [2], "options": {"retries": 1}}
    # A stale owner's retry records nothing.
    assert store.release("t1", "host/1/a", state.owner_token - 1, status=LeaseStatus.RETRYING, call=retry) != "ok"
    assert json.loads(redis_client.hget(key, "call")) == before  # type: ignore[arg-type]
    assert store.release("t1", "host/1/a", state.owner_token, status=LeaseStatus.RETRYING, call=retry) == "ok"
    assert json.loads(redis_client.hget(key, "call")) == retry  # type: ignore[arg-type]


def test_hand_off_by_an_owner_that_lost_the_lease_is_refused(store: LeaseStore) -> None:
    state = held(store, ttl=30)
    wait_for(lambda: store.server_time_ms() > (state.lease_expire_at or 0))
    acquire(store, owner="host/2/b")  # taken over
    assert store.hand_off("t1", "host/1/a", state.owner_token) == "stale-token"
    assert store.read("t1") is not None
