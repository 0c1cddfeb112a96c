"""The store's retry policy: a call of a task's path runs again after a connection error; the
heartbeat's report of a stall runs once (its next tick tries again)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry as ConnectionRetry

from celery_fenced._backend.backend import celery_retry
from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.state import (
    AcquireOutcome,
    LapseOutcome,
    LeaseStatus,
    ReleaseOutcome,
    Reservation,
    ReserveOutcome,
    StoreOutcome,
)
from celery_fenced._lease.store import LeaseStore
from tests.support.redis_server import RedisServer
from tests.unit.lease.helpers import acquire

#: Celery's retry loop, with short waits: the pause below outlasts a few of its calls.
POLICY = {"max_retries": 50, "interval_start": 0, "interval_step": 0.05, "interval_max": 0.1}
ERRORS = (redis.ConnectionError, redis.TimeoutError)
OWNER = "host/1/a"


#: A database of the session's server of its own (the behaviour is the store's, not the server's).
DB = 5


@pytest.fixture
def admin(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client(DB)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def impatient(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of that database that gives up on a reply within 0.2 s and whose connections
    retry nothing themselves: every timeout reaches the store."""
    client = redis.Redis.from_url(redis_server.url(DB), socket_timeout=0.2, retry=ConnectionRetry(NoBackoff(), 0))
    yield client
    client.close()


def reservation(task_id: str) -> Reservation:
    return Reservation(task_id, 60_000, "proj.task", None, 3)


def paused(store: LeaseStore, admin: redis.Redis, call: Callable[[], Any]) -> Any:
    """``call()`` while the server holds every script for 0.6 s: each try times out until then."""
    store.reserve_many([reservation("warm-up")], "host")  # every script loaded, the connection made
    admin.client_pause(600, all=False)
    try:
        return call()
    finally:
        admin.client_unpause()


def token_of(store: LeaseStore, task_id: str = "t1") -> int:
    return acquire(store, task_id, OWNER).token  # type: ignore[no-any-return]


#: Each call of a task's path: (what it needs first, the call, what it answers).
TASK_PATH: dict[str, tuple[Callable[[LeaseStore], Any], Callable[[LeaseStore, Any], Any], Any]] = {
    "reserve": (lambda s: None, lambda s, _: s.reserve_many([reservation("t1")], "host"), [ReserveOutcome.RESERVED]),
    "lapse_reserved": (
        lambda s: s.reserve_many([reservation("t1")], "host"),
        lambda s, _: s.lapse_reserved(["t1"], "host"),
        1,
    ),
    "acquire": (
        lambda s: None,
        lambda s, _: acquire(s, "t1", OWNER).outcome,
        AcquireOutcome.NEW,
    ),
    "release": (
        token_of,
        lambda s, token: s.release("t1", OWNER, token, status=LeaseStatus.DONE),
        ReleaseOutcome.OK,
    ),
    "hand_off": (token_of, lambda s, token: s.hand_off("t1", OWNER, token), ReleaseOutcome.OK),
    "lapse unfinished": (token_of, lambda s, token: s.lapse("t1", OWNER, token, mode="unfinished"), LapseOutcome.OK),
    "store": (
        token_of,
        lambda s, token: s.store("t1", token, b"{}", state="SUCCESS", kind="ready", expires_ms=0, owner_id=OWNER).code,
        StoreOutcome.STORED,
    ),
}


@pytest.mark.parametrize("name", TASK_PATH)
def test_a_call_of_a_tasks_path_runs_again_after_a_connection_error(
    name: str, impatient: redis.Redis, admin: redis.Redis
) -> None:
    before, call, answer = TASK_PATH[name]
    store = LeaseStore(impatient, KeySpace.build("fenced", "celery-task-meta-"), retry=celery_retry(ERRORS, POLICY))
    given = before(store)
    assert paused(store, admin, lambda: call(store, given)) == answer
    store.close()


def test_without_a_retry_policy_a_call_runs_once(impatient: redis.Redis, admin: redis.Redis) -> None:
    store = LeaseStore(impatient, KeySpace.build("fenced", "celery-task-meta-"))
    with pytest.raises(redis.TimeoutError):
        paused(store, admin, lambda: store.reserve_many([reservation("t1")], "host"))
    store.close()


def test_the_heartbeats_report_of_a_stall_runs_once(impatient: redis.Redis, admin: redis.Redis) -> None:
    store = LeaseStore(impatient, KeySpace.build("fenced", "celery-task-meta-"), retry=celery_retry(ERRORS, POLICY))
    token = token_of(store)
    with pytest.raises(redis.TimeoutError):
        paused(store, admin, lambda: store.lapse("t1", OWNER, token, mode="release"))
    store.close()
