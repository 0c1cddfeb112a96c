"""worker_alive.lua, lapse_worker.lua and worker_left.lua: a dead worker's reservations are due at
once; a live worker's backlog waits for its start timeout."""

from __future__ import annotations

import pytest
import redis

from celery_fenced._lease import liveness_store
from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.liveness_store import hostname_of, worker_id_of
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import acquire, claim, server_ms, wait_for
from tests.unit.lease.test_reserve import reservation

HOUR = 3_600_000


@pytest.fixture
def store(redis_client: redis.Redis) -> LeaseStore:
    return LeaseStore(redis_client, KeySpace.build("fenced", "celery-task-meta-"))


def due_at(store: LeaseStore, client: redis.Redis, task_id: str) -> float | None:
    return client.zscore(store.keys.index, store.keys.lease(task_id))


def test_a_live_workers_backlog_is_left_to_its_start_timeout(store: LeaseStore, redis_client: redis.Redis) -> None:
    store.liveness.worker_alive("w1@host", HOUR)
    store.reserve_many([reservation(f"t{n}", expires_in_ms=HOUR) for n in range(50)], "w1@host")
    assert store.liveness.lapse_dead_workers() == {}
    assert all(due_at(store, redis_client, f"t{n}") > server_ms(redis_client) + HOUR / 2 for n in range(50))  # type: ignore[operator]


def test_a_lapsed_workers_unstarted_reservations_are_due_now_and_sent_again(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    store.liveness.worker_alive("dead@host", 50)
    store.liveness.worker_alive("live@host", HOUR)
    store.reserve_many([reservation(task_id, expires_in_ms=HOUR) for task_id in ("a", "b", "started")], "dead@host")
    store.reserve_many([reservation("theirs", expires_in_ms=HOUR)], "live@host")
    acquire(store, "started", owner="dead@host/1/x")  # one of them started before the worker died
    wait_for(lambda: server_ms(redis_client) > 60 + int(redis_client.zscore(store.keys.workers, "dead@host") or 0))

    assert store.liveness.lapse_dead_workers() == {"dead@host": 2}
    now = server_ms(redis_client)
    assert due_at(store, redis_client, "a") <= now and due_at(store, redis_client, "b") <= now  # type: ignore[operator]
    assert due_at(store, redis_client, "theirs") > now + HOUR / 2  # type: ignore[operator]
    assert store.read("started").status == "RUNNING"  # type: ignore[union-attr]
    assert [(r.code, r.cause) for r in claim(store, "a", "b")] == [("requeued", "unstarted")] * 2
    # The record and its set are gone: a second pass finds nothing to do.
    assert redis_client.zscore(store.keys.workers, "dead@host") is None
    assert not redis_client.exists(store.keys.reserved_by("dead@host"))
    assert store.liveness.lapse_dead_workers() == {}


def test_a_record_renewed_in_time_is_never_lapsed(store: LeaseStore, redis_client: redis.Redis) -> None:
    store.liveness.worker_alive("w1@host", 200)
    store.reserve_many([reservation("t1", expires_in_ms=HOUR)], "w1@host")
    for _ in range(5):
        store.liveness.worker_alive("w1@host", 200)
        assert store.liveness.lapse_dead_workers() == {}
    assert due_at(store, redis_client, "t1") > server_ms(redis_client) + HOUR / 2  # type: ignore[operator]


def test_a_reservation_another_worker_took_since_is_left_to_it(store: LeaseStore, redis_client: redis.Redis) -> None:
    store.liveness.worker_alive("dead@host", 50)
    store.reserve_many([reservation("t1", expires_in_ms=HOUR)], "dead@host")
    store.reserve_many([reservation("t1", expires_in_ms=HOUR)], "other@host")  # the message received again
    wait_for(lambda: server_ms(redis_client) > 60 + int(redis_client.zscore(store.keys.workers, "dead@host") or 0))
    assert store.liveness.lapse_dead_workers() == {"dead@host": 0}
    assert store.read("t1").reserved_by == "other@host"  # type: ignore[union-attr]


def test_a_workers_set_keeps_only_reservations_not_yet_due(store: LeaseStore, redis_client: redis.Redis) -> None:
    store.reserve_many([reservation("soon", expires_in_ms=0)], "w1@host")
    store.reserve_many([reservation("later", expires_in_ms=HOUR)], "w1@host")
    members = {m.decode() for m in redis_client.zrange(store.keys.reserved_by("w1@host"), 0, -1)}
    assert members == {store.keys.lease("later")}


def test_a_worker_that_left_has_no_record(store: LeaseStore, redis_client: redis.Redis) -> None:
    store.liveness.worker_alive("w1@host", 50)
    store.reserve_many([reservation("t1", expires_in_ms=HOUR)], "w1@host")
    store.liveness.worker_left("w1@host")
    assert redis_client.zscore(store.keys.workers, "w1@host") is None
    assert store.liveness.lapse_dead_workers() == {}


def test_a_worker_restarted_under_its_name_does_not_keep_its_dead_starts_reservations(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # A supervisor, or a container restarted in its pod: the same hostname, another start.
    dead, restarted = worker_id_of("w1@host", 7, "aaaa"), worker_id_of("w1@host", 7, "bbbb")
    store.liveness.worker_alive(dead, 50)
    store.reserve_many([reservation("held", expires_in_ms=HOUR)], "w1@host", dead)
    store.liveness.worker_alive(restarted, HOUR)
    store.reserve_many([reservation("new", expires_in_ms=HOUR)], "w1@host", restarted)
    wait_for(lambda: server_ms(redis_client) > 60 + int(redis_client.zscore(store.keys.workers, dead) or 0))
    assert store.liveness.lapse_dead_workers() == {dead: 1}
    assert due_at(store, redis_client, "held") <= server_ms(redis_client)  # type: ignore[operator]
    assert due_at(store, redis_client, "new") > server_ms(redis_client) + HOUR / 2  # type: ignore[operator]
    assert hostname_of(dead) == "w1@host"


def test_lapse_worker_touches_only_the_leases_it_is_given_and_asks_for_the_rest(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # The script names every key it touches in KEYS: the caller reads the worker's set and
    # passes its members; a reservation the caller did not pass waits for the next call.
    store.liveness.worker_alive("dead@host", 50)
    store.reserve_many([reservation(task_id, expires_in_ms=HOUR) for task_id in ("a", "b")], "dead@host")
    wait_for(lambda: server_ms(redis_client) > 60 + int(redis_client.zscore(store.keys.workers, "dead@host") or 0))
    reservations = store.keys.reserved_by("dead@host")
    fixed = [store.keys.workers, store.keys.index, reservations]
    args = ["dead@host", hostname_of("dead@host")]

    code, count = store.scripts.lapse_worker(keys=[*fixed, store.keys.lease("a")], args=args)
    assert (code, count) == (b"more", 1)
    now = server_ms(redis_client)
    assert due_at(store, redis_client, "a") <= now  # type: ignore[operator]
    assert due_at(store, redis_client, "b") > now + HOUR / 2  # type: ignore[operator]
    assert redis_client.zscore(store.keys.workers, "dead@host") is not None  # kept until the set is empty

    # A key the set does not hold is left alone, even a reservation of the same host's.
    store.reserve_many([reservation("elsewhere", expires_in_ms=HOUR)], "dead@host/2")
    code, count = store.scripts.lapse_worker(
        keys=[*fixed, store.keys.lease("b"), store.keys.lease("elsewhere")], args=args
    )
    assert (code, count) == (b"lapsed", 1)
    assert due_at(store, redis_client, "elsewhere") > now + HOUR / 2  # type: ignore[operator]
    assert redis_client.zscore(store.keys.workers, "dead@host") is None


def test_a_dead_workers_reservations_beyond_one_batch_are_all_made_due(
    store: LeaseStore, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(liveness_store, "_LAPSE_WORKER_BATCH", 3)
    store.liveness.worker_alive("dead@host", 50)
    store.reserve_many([reservation(f"t{n}", expires_in_ms=HOUR) for n in range(7)], "dead@host")
    wait_for(lambda: server_ms(redis_client) > 60 + int(redis_client.zscore(store.keys.workers, "dead@host") or 0))
    assert store.liveness.lapse_dead_workers() == {"dead@host": 7}
    assert not redis_client.exists(store.keys.reserved_by("dead@host"))
