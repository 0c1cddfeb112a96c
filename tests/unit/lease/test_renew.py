"""renew.lua: renewals of many leases in one call, their refusals, and the server's clock."""

from __future__ import annotations

import time

import pytest
import redis

from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import TTL, acquire, held, renew_req, server_ms, wait_for


def test_renew_extends_and_publishes_progress_from_server_time(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = held(store)
    codes = store.renew_many([renew_req(state, stage="load-data", progress_version=2, progress_age_ms=400)])
    assert codes == ["ok"]
    after = store.read("t1")
    assert after is not None
    now = server_ms(redis_client)
    assert after.current_stage == "load-data"
    assert after.progress_version == 2
    assert after.last_progress_at is not None and now - 1000 <= after.last_progress_at <= now - 400
    assert after.lease_expire_at is not None and after.lease_expire_at > (state.lease_expire_at or 0) - 1


def test_progress_version_never_moves_back(store: LeaseStore) -> None:
    state = held(store)
    store.renew_many([renew_req(state, stage="b", progress_version=5, progress_age_ms=0)])
    store.renew_many([renew_req(state, stage="a", progress_version=3, progress_age_ms=0)])
    after = store.read("t1")
    assert after is not None and after.progress_version == 5 and after.current_stage == "b"


def test_renew_with_stale_token_or_wrong_owner_is_refused(store: LeaseStore) -> None:
    first = acquire(store, ttl=50)
    lease = store.read("t1")
    assert lease is not None
    wait_for(lambda: store.server_time_ms() > (lease.lease_expire_at or 0))
    second = held(store, owner="host/2/b")
    assert store.renew_many([renew_req(first.state)]) == ["stale-token"]
    assert store.renew_many([renew_req(second, owner="host/1/a")]) == ["not-owner"]
    assert store.renew_many([renew_req(second, owner="host/2/b")]) == ["ok"]


def test_renew_just_past_expiry_is_accepted_when_nothing_claimed(store: LeaseStore) -> None:
    state = held(store, ttl=30)
    wait_for(lambda: store.server_time_ms() > (state.lease_expire_at or 0) + 20)
    assert store.renew_many([renew_req(state)]) == ["ok"]


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ("REQUEUED", "claimed"),
        ("ABANDONED", "claimed"),
        ("LAPSED", "lapsed"),
        ("DONE", "finished"),
        ("RETRYING", "retrying"),
    ],
)
def test_renew_refused_once_the_lease_moved_on(
    store: LeaseStore, redis_client: redis.Redis, status: str, code: str
) -> None:
    state = held(store)
    redis_client.hset(store.keys.lease("t1"), "status", status)
    assert store.renew_many([renew_req(state)]) == [code]


def test_renew_of_an_owner_whose_task_was_taken_over_and_finished_says_taken_over(store: LeaseStore) -> None:
    first = held(store, ttl=50)
    wait_for(lambda: store.server_time_ms() > (first.lease_expire_at or 0) + 20)
    second = held(store, owner="host/2/b")  # the takeover
    done = store.store("t1", second.owner_token, b"{}", state="SUCCESS", kind="ready", expires_ms=0)
    assert done.detail == "DONE"
    assert store.renew_many([renew_req(first)]) == ["stale-token"]  # not "finished": it was taken over
    assert store.renew_many([renew_req(second, owner="host/2/b")]) == ["finished"]


def test_renew_of_a_missing_lease(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = held(store)
    redis_client.delete(store.keys.lease("t1"))
    assert store.renew_many([renew_req(state)]) == ["missing"]


def test_many_leases_renew_in_one_round_trip(store: LeaseStore, redis_client: redis.Redis) -> None:
    states = [held(store, task_id=f"b{i}") for i in range(100)]
    redis_client.config_resetstat()
    codes = store.renew_many([renew_req(s) for s in states])
    assert codes == ["ok"] * 100
    stats = redis_client.info("commandstats")
    evals = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    assert evals == 1


def test_alert_stall_marks_stalled_and_keeps_the_lease(store: LeaseStore) -> None:
    state = held(store)
    assert store.renew_many([renew_req(state, stalled=True)]) == ["ok"]
    after = store.read("t1")
    assert after is not None and after.status == "STALLED" and after.stalled_at is not None
    wait_for(lambda: store.server_time_ms() > (after.stalled_at or 0))
    assert store.renew_many([renew_req(state, stalled=True)]) == ["ok"]
    still = store.read("t1")
    assert still is not None and still.stalled_at == after.stalled_at  # since the first stalled renewal
    assert store.renew_many([renew_req(state, progress_version=1)]) == ["ok"]
    back = store.read("t1")
    assert back is not None and back.status == "RUNNING" and back.stalled_at is None


def test_expiries_come_from_the_server_clock_not_the_clients(
    store: LeaseStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 600)  # a client 10 minutes ahead
    monkeypatch.setattr(time, "time_ns", lambda: int((real_time() + 600) * 1e9))
    state = held(store)
    store.renew_many([renew_req(state, progress_version=1, progress_age_ms=100)])
    after = store.read("t1")
    now = server_ms(redis_client)
    assert after is not None and after.lease_expire_at is not None and after.last_progress_at is not None
    assert abs(after.lease_expire_at - (now + TTL)) < 1000
    assert abs(after.last_progress_at - (now - 100)) < 1000


def test_an_older_tokens_lease_answers_a_newer_owner_as_missing(store: LeaseStore, redis_client: redis.Redis) -> None:
    # Tokens are handed out in order: a lease of an older token where a newer owner renews was
    # written after the store lost that owner's lease (an older owner's write-back, a copy of
    # the message reserved). The newer owner is told its lease is missing, and writes it back.
    older = acquire(store, ttl=50)
    lease = store.read("t1")
    assert lease is not None
    wait_for(lambda: store.server_time_ms() > (lease.lease_expire_at or 0))
    newer = held(store, owner="host/2/b")
    for status in ("LAPSED", "RUNNING", "REQUEUED", "RESERVED"):
        redis_client.hset(store.keys.lease("t1"), mapping={"status": status, "ownerToken": older.token})
        assert store.renew_many([renew_req(newer, "host/2/b")]) == ["missing"]
    redis_client.hdel(store.keys.lease("t1"), "ownerToken")  # a reservation: no token at all
    assert store.renew_many([renew_req(newer, "host/2/b")]) == ["missing"]
    # The other way round, as before: an older owner is refused by a newer token.
    redis_client.hset(store.keys.lease("t1"), mapping={"status": "RUNNING", "ownerToken": newer.owner_token})
    assert store.renew_many([renew_req(newer, token=older.token)]) == ["stale-token"]
