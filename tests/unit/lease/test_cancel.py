"""cancel.lua: a cancelled task is fenced for good."""

from __future__ import annotations

import redis

from celery_fenced._lease.state import AcquireOutcome
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import acquire, held, renew_req


def test_cancel_fences_the_owner_and_stops_later_deliveries(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = held(store)
    assert store.cancel("t1", lambda token: f"revoked:{token}".encode(), expires_ms=0).code == "cancelled"
    after = store.read("t1")
    assert after is not None and after.status == "DONE" and after.owner_token > state.owner_token
    assert redis_client.get(store.keys.result("t1")) == f"revoked:{after.owner_token}".encode()
    assert store.renew_many([renew_req(state)]) == ["cancelled"]  # the owner learns why
    assert acquire(store, owner="host/2/b").outcome is AcquireOutcome.DONE
    assert store.cancel("t1", lambda token: b"x", expires_ms=0).code == "finished"
    assert store.cancel("never-started", lambda token: b"r", expires_ms=0).code == "unknown"
    assert store.read("never-started") is None and redis_client.get(store.keys.result("never-started")) is None
    assert store.cancel("never-started", lambda token: b"r", expires_ms=0, unknown_too=True).code == "cancelled"
    assert acquire(store, task_id="never-started").outcome is AcquireOutcome.DONE
    redis_client.set(store.keys.result("lease-expired"), b"SUCCESS meta")
    assert store.cancel("lease-expired", lambda token: b"r", expires_ms=0).code == "finished"
    assert redis_client.get(store.keys.result("lease-expired")) == b"SUCCESS meta"
