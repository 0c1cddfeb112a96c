"""store.lua: the fenced result write, tokenless writes from the worker's main process, and plain tasks."""

from __future__ import annotations

import time

import redis

from celery_fenced._lease.state import AcquireOutcome, LeaseStatus
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import acquire, held, server_ms, wait_for


def test_store_success_with_current_token_writes_publishes_and_ends_the_lease(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    state = held(store)
    pubsub = redis_client.pubsub()
    pubsub.subscribe(store.keys.result("t1"))
    wait_for(lambda: pubsub.get_message(timeout=0.1) is not None)  # the subscribe confirmation
    result = store.store(
        "t1",
        state.owner_token,
        b'{"status": "SUCCESS"}',
        state="SUCCESS",
        kind="ready",
        expires_ms=86_400_000,
    )
    assert result.stored and result.detail == "DONE"
    assert redis_client.get(store.keys.result("t1")) == b'{"status": "SUCCESS"}'
    message = None
    deadline = time.monotonic() + 5
    while message is None and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.1)
    assert message is not None and message["data"] == b'{"status": "SUCCESS"}'
    lease_ttl = redis_client.pttl(store.keys.lease("t1"))
    result_ttl = redis_client.pttl(store.keys.result("t1"))
    assert lease_ttl > 0 and result_ttl - 1000 <= lease_ttl  # never expires before the result
    assert store.read("t1").status == "DONE"  # type: ignore[union-attr]


def test_store_with_stale_token_writes_nothing(store: LeaseStore, redis_client: redis.Redis) -> None:
    first = acquire(store, ttl=50)
    lease = store.read("t1")
    assert lease is not None
    wait_for(lambda: store.server_time_ms() > (lease.lease_expire_at or 0))
    second = held(store, owner="host/2/b")
    assert store.store("t1", second.owner_token, b"new", state="SUCCESS", kind="ready", expires_ms=0).stored
    stale = store.store("t1", first.state.owner_token, b"old", state="SUCCESS", kind="ready", expires_ms=0)
    assert stale.code == "stale" and stale.detail == str(second.owner_token)
    assert redis_client.get(store.keys.result("t1")) == b"new"


def test_started_and_custom_states_keep_the_lease_running(store: LeaseStore) -> None:
    state = held(store)
    for name in ("STARTED", "PROGRESSING"):
        assert store.store("t1", state.owner_token, name.encode(), state=name, kind="other", expires_ms=0).stored
        assert store.read("t1").status == "RUNNING"  # type: ignore[union-attr]


def test_retry_makes_the_lease_retrying_until_eta_plus_timeout(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = held(store)
    result = store.store("t1", state.owner_token, b"r", state="RETRY", kind="retry", expires_ms=0, retry_due_ms=10_000)
    assert result.stored and result.detail == "RETRYING"
    after = store.read("t1")
    assert after is not None and after.lease_expire_at is not None
    assert after.lease_expire_at > server_ms(redis_client) + 8000
    assert acquire(store, owner="host/1/retry").outcome is AcquireOutcome.TAKEOVER


def test_write_after_done_is_refused(store: LeaseStore) -> None:
    state = held(store)
    store.store("t1", state.owner_token, b"ok", state="SUCCESS", kind="ready", expires_ms=0)
    again = store.store("t1", state.owner_token, b"fail", state="FAILURE", kind="ready", expires_ms=0)
    assert again.code == "finished"


def test_tokenless_worker_lost_of_the_owner_process_lapses_instead_of_failing(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    acquire(store, owner="celery@w1/123/a")
    result = store.store(
        "t1",
        None,
        b"lost",
        state="FAILURE",
        kind="ready",
        expires_ms=0,
        writer="celery@w1/123/",
        worker_lost=True,
    )
    assert result.code == "lapsed"
    assert redis_client.get(store.keys.result("t1")) is None
    after = store.read("t1")
    assert after is not None and after.status == "LAPSED" and after.raw["lapseReason"] == "worker-lost"


def test_tokenless_end_whose_message_is_put_back_leaves_the_lease_requeued(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # A hard time limit with late acks and acks_on_failure_or_timeout off: Celery stores the
    # FAILURE, then puts the message back to run the task again.
    acquire(store, owner="celery@w1/123/a")
    args = {"state": "FAILURE", "kind": "ready", "expires_ms": 0, "retry_due_ms": 60_000, "put_back": True}
    assert store.store("t1", None, b"limit", writer="celery@w9/123/", **args).code == "foreign"  # type: ignore[arg-type]
    result = store.store("t1", None, b"limit", writer="celery@w1/123/", **args)  # type: ignore[arg-type]
    assert (result.code, result.detail) == ("stored", "REQUEUED")
    assert redis_client.get(store.keys.result("t1")) == b"limit"
    after = store.read("t1")
    assert after is not None and after.status == "REQUEUED"
    assert (after.lease_expire_at or 0) > store.server_time_ms() + 50_000
    assert acquire(store, owner="celery@w2/7/b").outcome.value == "takeover"  # the message put back runs
    # gevent's hard limit: the owner's body gave the lease up (unfinished) before the write.
    state = store.read("t1")
    assert state is not None
    assert store.lapse("t1", "celery@w2/7/b", state.owner_token, mode="unfinished") == "ok"
    again = store.store("t1", None, b"limit 2", writer="celery@w2/7/", **args)  # type: ignore[arg-type]
    assert (again.code, again.detail) == ("stored", "REQUEUED")


def test_tokenless_write_from_another_host_is_dropped(store: LeaseStore, redis_client: redis.Redis) -> None:
    acquire(store, owner="celery@w2/5/a")
    lost = store.store(
        "t1",
        None,
        b"x",
        state="FAILURE",
        kind="ready",
        expires_ms=0,
        writer="celery@w1/5/",
        worker_lost=True,
    )
    limit = store.store("t1", None, b"x", state="FAILURE", kind="ready", expires_ms=0, writer="celery@w1/5/")
    assert lost.code == "foreign" and limit.code == "foreign"
    assert redis_client.get(store.keys.result("t1")) is None


def test_tokenless_write_from_another_process_of_the_owner_host_is_dropped(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # A stalled attempt's time limit or lost child, on the same machine as the new owner.
    acquire(store, owner="celery@w1/123/a")
    for worker_lost in (True, False):
        answer = store.store(
            "t1",
            None,
            b"x",
            state="FAILURE",
            kind="ready",
            expires_ms=0,
            writer="celery@w1/77/",
            worker_lost=worker_lost,
        )
        assert answer.code == "foreign"
    assert store.read("t1").status == "RUNNING"  # type: ignore[union-attr]
    assert redis_client.get(store.keys.result("t1")) is None


def test_tokenless_revoke_of_the_owner_process_is_terminal(store: LeaseStore) -> None:
    acquire(store, owner="celery@w2/5/a")
    result = store.store("t1", None, b"revoked", state="REVOKED", kind="ready", expires_ms=0, writer="celery@w2/5/")
    assert result.stored
    assert store.read("t1").status == "DONE"  # type: ignore[union-attr]


def test_tokenless_revoke_of_an_unstarted_copy_leaves_a_live_owner_alone(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # A duplicate whose message expired (or was revoked) before it started: no process ran it.
    acquire(store, owner="celery@w2/5/a")
    result = store.store("t1", None, b"revoked", state="REVOKED", kind="ready", expires_ms=0, writer="")
    assert result.code == "foreign"
    assert store.read("t1").status == "RUNNING"  # type: ignore[union-attr]
    assert redis_client.get(store.keys.result("t1")) is None


def test_tokenless_revoke_without_a_live_owner_is_terminal(store: LeaseStore) -> None:
    state = held(store, owner="celery@w2/5/a")
    store.release("t1", "celery@w2/5/a", state.owner_token, status=LeaseStatus.REQUEUED, due_in_ms=60_000)
    result = store.store("t1", None, b"revoked", state="REVOKED", kind="ready", expires_ms=0, writer="")
    assert result.stored
    assert store.read("t1").status == "DONE"  # type: ignore[union-attr]


def test_write_without_a_lease_behaves_like_celery(store: LeaseStore, redis_client: redis.Redis) -> None:
    assert store.store("plain", None, b'{"status": "STARTED"}', state="STARTED", kind="other", expires_ms=0).stored
    assert store.store("plain", None, b'{"status": "SUCCESS"}', state="SUCCESS", kind="ready", expires_ms=5000).stored
    again = store.store("plain", None, b'{"status": "FAILURE"}', state="FAILURE", kind="ready", expires_ms=0)
    assert again.code == "sticky"
    assert redis_client.get(store.keys.result("plain")) == b'{"status": "SUCCESS"}'
    assert redis_client.exists(store.keys.lease("plain")) == 0


def test_a_result_write_asked_again_by_its_writer_gets_the_same_answer(store: LeaseStore) -> None:
    state = held(store)
    first = store.store("t1", state.owner_token, b"ok", state="SUCCESS", kind="ready", expires_ms=0)
    again = store.store("t1", state.owner_token, b"ok", state="SUCCESS", kind="ready", expires_ms=0)
    assert first.code == again.code == "stored" and again.detail == "DONE"
    other = store.store("t1", state.owner_token, b"x", state="FAILURE", kind="ready", expires_ms=0)
    changed = store.store("t1", state.owner_token, b"changed", state="SUCCESS", kind="ready", expires_ms=0)
    assert other.code == changed.code == "finished"


def test_a_main_process_end_of_an_unfinished_body_is_still_stored(store: LeaseStore) -> None:
    # The owner's body stopped (a hard time limit on gevent, a revoke): its lease lapsed at the
    # body's end; the main process's FAILURE or REVOKED for that owner still lands, as Celery's.
    for state in ("FAILURE", "REVOKED"):
        task_id = f"t-{state}"
        lease = held(store, task_id, owner="celery@w2/5/a")
        assert store.lapse(task_id, "celery@w2/5/a", lease.owner_token, mode="unfinished") == "ok"
        result = store.store(task_id, None, b"ended", state=state, kind="ready", expires_ms=0, writer="celery@w2/5/")
        assert result.stored
        assert store.read(task_id).status == "DONE"  # type: ignore[union-attr]


def test_a_cancelled_requests_retry_of_the_owner_process_lapses_instead_of_retrying(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # A cold shutdown: Celery cancels the running request and writes RETRY, though nothing
    # will retry it. The lease lapses for a takeover; nothing is stored.
    acquire(store, owner="celery@w1/123/a")
    args = {"state": "RETRY", "kind": "retry", "expires_ms": 0, "writer": "celery@w1/123/", "worker_lost": True}
    assert store.store("t1", None, b"cancelled", **args).code == "lapsed"  # type: ignore[arg-type]
    assert redis_client.get(store.keys.result("t1")) is None
    after = store.read("t1")
    assert after is not None and after.status == "LAPSED"
    # Its body's own end, seen later, changes nothing.
    assert store.store("t1", None, b"cancelled", **args).code == "foreign"  # type: ignore[arg-type]


def test_a_tokenless_failure_of_a_reservation_lands_only_from_its_host_or_a_pool_process(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # A delivery that could not take its lease (a Redis that kept refusing: LeaseUnavailableError)
    # fails before it ran: its FAILURE ends the reservation, so the reaper does not send it again.
    from tests.unit.lease.test_reserve import reservation

    for task_id in ("mine", "pool", "theirs", "success"):
        store.reserve_many([reservation(task_id)], "w1@host")
    other_host = store.store("theirs", None, b"x", state="FAILURE", kind="ready", expires_ms=0, writer="w2@host/9/")
    assert other_host.code == "foreign"
    success = store.store("success", None, b"x", state="SUCCESS", kind="ready", expires_ms=0, writer="")
    assert success.code == "foreign"
    assert store.store("mine", None, b"x", state="FAILURE", kind="ready", expires_ms=0, writer="w1@host/7/").stored
    assert store.store("pool", None, b"x", state="FAILURE", kind="ready", expires_ms=0, writer="").stored
    for task_id in ("mine", "pool"):
        assert store.read(task_id).status == "DONE"  # type: ignore[union-attr]
        assert redis_client.get(store.keys.result(task_id)) == b"x"
    assert store.read("theirs").status == "RESERVED"  # type: ignore[union-attr]


# -- the lease store lost data (FLUSHDB, a restart without persistence, an eviction) -------------


def _taken_over(store: LeaseStore) -> tuple[int, int]:
    """Owner A froze, its lease expired, owner B took the task over: their tokens."""
    first = acquire(store, owner="host/1/a", ttl=50)
    lease = store.read("t1")
    assert lease is not None
    wait_for(lambda: store.server_time_ms() > (lease.lease_expire_at or 0))
    second = held(store, owner="host/2/b")
    return first.token, second.owner_token


def _success(token: int) -> bytes:
    return b'{"status": "SUCCESS", "result": %d, "fence_run": "p1/1/0", "fence_token": %d}' % (token, token)


def test_after_a_flush_a_stale_owners_write_is_refused_as_missing(store: LeaseStore, redis_client: redis.Redis) -> None:
    old, new = _taken_over(store)
    redis_client.flushdb()
    refused = store.store("t1", old, _success(old), state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/1/a")
    assert refused.code == "missing"
    assert redis_client.get(store.keys.result("t1")) is None  # nothing stored, nothing published
    # The current owner's write is refused the same way until it has its lease back (restore.lua).
    current = store.store("t1", new, _success(new), state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/2/b")
    assert current.code == "missing"
    for state in ("STARTED", "FAILURE"):
        kind = "ready" if state == "FAILURE" else "other"
        assert store.store("t1", old, b"{}", state=state, kind=kind, expires_ms=0).code == "missing"


def test_after_the_result_and_the_counter_were_evicted_a_stale_owners_success_is_refused(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    old, new = _taken_over(store)
    assert store.store("t1", new, _success(new), state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/2/b")
    redis_client.delete(store.keys.lease("t1"))  # the lease hash evicted (or only the compact form left)
    for state in ("SUCCESS", "FAILURE", "REVOKED"):  # never over a result with a higher fence
        stale = store.store("t1", old, _success(old), state=state, kind="ready", expires_ms=0)
        assert stale.code == "stale" and stale.detail == str(new)
    redis_client.delete(store.keys.result("t1"), store.keys.token)  # then the result and the counter
    refused = store.store("t1", old, _success(old), state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/1/a")
    assert refused.code == "missing"
    assert redis_client.get(store.keys.result("t1")) is None


def test_a_tokenless_write_without_a_lease_is_still_stored_as_celery_stores_it(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # A plain task (no lease, no token): Celery's own write, unchanged.
    assert store.store("plain", None, b'{"status": "FAILURE"}', state="FAILURE", kind="ready", expires_ms=0).stored
    assert redis_client.get(store.keys.result("plain")) == b'{"status": "FAILURE"}'
