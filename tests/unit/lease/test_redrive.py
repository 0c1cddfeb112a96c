"""redrive.lua: an abandoned task goes back for a fresh set of takeovers."""

from __future__ import annotations

import redis

from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import claim, held


def test_redrive_puts_an_abandoned_task_back(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = held(store, max_takeovers=0)
    store.lapse("t1", "host/1/a", state.owner_token, mode="release")
    assert claim(store, "t1")[0].code == "abandoned"
    assert store.abandoned_task_ids() == ["t1"] and store.abandoned_count() == 1
    assert store.redrive("t1") == "redriven"
    assert store.abandoned_task_ids() == [] and store.abandoned_count() == 0
    assert redis_client.get(store.keys.result("t1")) is None
    [result] = claim(store, "t1")
    assert result.code == "abandoned"  # max_takeovers=0 still: the policy is the task's
    assert store.redrive("t1") == "redriven"
    redis_client.hset(store.keys.lease("t1"), "maxTakeovers", 3)
    [result] = claim(store, "t1")
    assert result.code == "requeued" and result.cause == "redrive"
    assert store.redrive("t1") == "not-abandoned"
    assert store.redrive("nothing") == "missing"
