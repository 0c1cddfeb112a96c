"""release.lua: the end of a lease no result write ended; the hand-off to a replacement."""

from __future__ import annotations

import pytest
import redis

from celery_fenced.state import AcquireOutcome, LeaseStatus
from celery_fenced.store import LeaseStore
from tests.unit.store.helpers import acquire, held, server_ms, wait_for


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


def test_hand_off_deletes_the_lease_and_the_replacement_takes_a_higher_token(store: LeaseStore) -> None:
    state = held(store)
    assert store.hand_off("t1", "host/1/a", state.owner_token) == "ok"
    assert store.read("t1") is None
    replacement = acquire(store, owner="host/2/b")
    assert replacement.outcome is AcquireOutcome.NEW and replacement.state.owner_token > state.owner_token


def test_hand_off_by_an_owner_that_lost_the_lease_is_refused(store: LeaseStore) -> None:
    state = held(store, ttl=30)
    wait_for(lambda: store.server_time_ms() > (state.lease_expire_at or 0))
    acquire(store, owner="host/2/b")  # taken over
    assert store.hand_off("t1", "host/1/a", state.owner_token) == "stale-token"
    assert store.read("t1") is not None
