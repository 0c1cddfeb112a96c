"""The hand-off to a replacement (``Task.replace()``), fenced like a write.

A hand-off leaves a HANDED_OFF record: only the current owner makes it, only the replacement's
message (it names the token it was handed off from) starts the task id afterwards, and a copy
of the replaced message never runs again, whatever the replacement's lease is doing. Each test
fails where the hand-off deleted the lease: the record's refusals had nothing to stand on.
"""

from __future__ import annotations

import json

import pytest
import redis

from celery_fenced._lease.finished import FENCE_RUN
from celery_fenced._lease.state import (
    AcquireOutcome,
    LeaseStatus,
    ProgressReport,
    RenewRequest,
    Reservation,
    RestoreOutcome,
)
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import acquire, claim, held, server_ms, wait_for

A, B, C = "host/1/a", "host/2/b", "host/3/c"
CALL = {"task": "proj.task", "args": [1], "kwargs": {}, "options": {"queue": "celery"}}
NEW_CALL = {"task": "proj.other", "args": [2], "kwargs": {}, "options": {"queue": "celery"}}


def meta(token: int, run: str, status: str = "SUCCESS") -> bytes:
    return json.dumps({"status": status, "result": 1, "task_id": "t1", FENCE_RUN: run, "fence_token": token}).encode()


def handed_off(store: LeaseStore) -> int:
    """A task run once under publish p1 and handed off by its owner A: A's token."""
    state = held(store, owner=A, call=CALL, publish_id="p1")
    assert store.hand_off("t1", A, state.owner_token, keep_ms=60_000) == "ok"
    return state.owner_token


def test_a_hand_off_leaves_a_record_that_only_the_replacement_starts(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    token = handed_off(store)
    record = store.read("t1")
    assert record is not None and record.status == LeaseStatus.HANDED_OFF
    assert (record.owner_token, record.raw["handoffToken"], record.raw["publishId"]) == (token, str(token), "p1")
    assert json.loads(record.raw["call"]) == CALL  # kept for a hand-back, with the takeover limit
    assert record.max_takeovers == 3 and 0 < redis_client.pttl(store.keys.lease("t1")) <= 60_000
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) is None

    copy = acquire(store, owner=B, call=CALL, publish_id="p1")  # a late copy of the replaced message
    assert copy.outcome == AcquireOutcome.HANDED_OFF and not copy.outcome.runs
    other = acquire(store, owner=B, call=CALL, publish_id="p1", handed_off_by=str(token + 100))
    assert other.outcome == AcquireOutcome.HANDED_OFF

    replacement = acquire(store, owner=C, call=NEW_CALL, publish_id="p1", handed_off_by=str(token))
    assert replacement.outcome == AcquireOutcome.NEW and replacement.token > token
    assert (replacement.attempt, replacement.takeovers) == (1, 0)
    assert redis_client.pttl(store.keys.lease("t1")) == -1  # a live lease: no expiry


def test_an_owner_that_lost_its_lease_cannot_hand_off_after_the_new_owner_did(store: LeaseStore) -> None:
    # The frozen owner A (token 1) was taken over by B, which handed the task off; A thaws.
    old = held(store, owner=A, call=CALL, publish_id="p1", ttl=1)
    store.lapse_now("t1")
    new = acquire(store, owner=B, call=CALL, publish_id="p1")
    assert new.outcome == AcquireOutcome.TAKEOVER
    assert store.hand_off("t1", B, new.token, keep_ms=60_000) == "ok"
    assert store.hand_off("t1", A, old.owner_token, keep_ms=60_000) == "stale-token"
    assert store.hand_off("t1", B, new.token, keep_ms=60_000) == "ok"  # asked again: the same answer
    record = store.read("t1")
    assert record is not None and record.status == LeaseStatus.HANDED_OFF and record.owner_token == new.token
    # The thawed owner's heartbeat and writes are refused too; the one that handed off is told "finished".
    assert store.renew_many([_renew(old.owner_token, A), _renew(new.token, B)]) == ["stale-token", "finished"]
    late = store.store(
        "t1", old.owner_token, meta(old.owner_token, "p1/1/0"), state="SUCCESS", kind="ready", expires_ms=0
    )
    assert (late.code, late.detail) == ("stale", str(new.token))


def test_a_missing_lease_is_no_hand_off(store: LeaseStore) -> None:
    assert store.hand_off("t1", A, 7, keep_ms=60_000) == "missing"
    assert store.read("t1") is None


def test_a_copy_of_the_replaced_message_never_runs_while_the_replacement_runs_or_after_it_finished(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    token = handed_off(store)
    replacement = acquire(store, owner=C, call=NEW_CALL, publish_id="p1", handed_off_by=str(token), ttl=1)
    assert replacement.outcome == AcquireOutcome.NEW
    assert acquire(store, owner=B, call=CALL, publish_id="p1").outcome == AcquireOutcome.HANDED_OFF  # live
    wait_for(lambda: store.server_time_ms() > (store.read("t1").lease_expire_at or 0))  # type: ignore[union-attr]
    assert acquire(store, owner=B, call=CALL, publish_id="p1").outcome == AcquireOutcome.HANDED_OFF  # expired
    # The replacement's own re-send (the reaper names the hand-off) takes it over.
    takeover = acquire(store, owner=B, call=NEW_CALL, publish_id="p1", handed_off_by=str(token))
    assert takeover.outcome == AcquireOutcome.TAKEOVER
    done = store.store(
        "t1",
        takeover.token,
        meta(takeover.token, "p1/2/0"),
        state="SUCCESS",
        kind="ready",
        expires_ms=60_000,
        owner_id=B,
    )
    assert done.stored
    assert acquire(store, owner=A, call=CALL, publish_id="p1").outcome == AcquireOutcome.DONE
    assert acquire(store, owner=A, call=NEW_CALL, publish_id="p1", handed_off_by=str(token)).outcome == "done"
    # Another apply of the task id runs again, as Celery allows.
    assert acquire(store, owner=A, call=CALL, publish_id="p2").outcome == AcquireOutcome.NEW


def test_the_reaper_resends_the_replacement_naming_the_hand_off(store: LeaseStore) -> None:
    token = handed_off(store)
    acquire(store, owner=C, call=NEW_CALL, publish_id="p1", handed_off_by=str(token), ttl=1)
    store.lapse_now("t1")
    (claimed,) = claim(store, "t1")
    assert claimed.code == "requeued" and claimed.state is not None
    assert claimed.state.raw["handoffToken"] == str(token) and claimed.state.call == NEW_CALL


def test_a_hand_off_record_is_claimed_as_finished(store: LeaseStore, redis_client: redis.Redis) -> None:
    handed_off(store)
    redis_client.zadd(store.keys.index, {store.keys.lease("t1"): 0})  # a stale index entry
    (claimed,) = claim(store, "t1")
    assert claimed.code == "finished"
    assert store.read("t1").status == LeaseStatus.HANDED_OFF  # type: ignore[union-attr]


def test_only_the_replacements_message_is_reserved(store: LeaseStore, redis_client: redis.Redis) -> None:
    token = handed_off(store)
    copy = Reservation("t1", 5000, "proj.task", CALL, 3, publish_id="p1")
    replacement = Reservation("t1", 5000, "proj.other", NEW_CALL, 3, publish_id="p1", handed_off_by=str(token))
    assert store.reserve_many([copy], "w1@host") == ["left"]
    assert store.read("t1").status == LeaseStatus.HANDED_OFF  # type: ignore[union-attr]
    assert store.reserve_many([replacement], "w2@host") == ["reserved"]
    reserved = store.read("t1")
    assert reserved is not None and reserved.status == LeaseStatus.RESERVED and reserved.call == NEW_CALL
    assert redis_client.pttl(store.keys.lease("t1")) == -1
    assert store.reserve_many([copy], "w1@host") == ["left"]  # a copy from before the hand-off
    assert acquire(store, owner=B, call=CALL, publish_id="p1").outcome == AcquireOutcome.HANDED_OFF
    started = acquire(store, owner=C, call=NEW_CALL, publish_id="p1", handed_off_by=str(token))
    assert (started.outcome, started.attempt, started.previous_status) == (AcquireOutcome.NEW, 1, "")


def test_a_replacement_that_is_not_fenced_stores_its_result_and_ends_the_record(store: LeaseStore) -> None:
    token = handed_off(store)
    assert store.replacement_sent("t1", A, token) == "ok"
    # The replaced run's own process, once its replacement was sent (its main process: a lost
    # child, a time limit), is refused.
    lost = store.store("t1", None, b'{"status": "FAILURE"}', state="FAILURE", kind="ready", expires_ms=0, writer=A[:7])
    assert (lost.code, lost.detail) == ("foreign", "HANDED_OFF")
    result = store.store(
        "t1", None, b'{"status": "SUCCESS"}', state="SUCCESS", kind="ready", expires_ms=0, handed_off_by=str(token)
    )
    assert result.stored
    done = store.read("t1")
    assert done is not None and done.status == LeaseStatus.DONE and done.raw["publishId"] == "p1"
    assert acquire(store, owner=B, call=CALL, publish_id="p1").outcome == AcquireOutcome.DONE


def test_a_frozen_owners_vanished_lease_is_not_restored(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = held(store, owner=A, call=CALL, publish_id="p1")

    def restore(age_ms: int, *, lapsed: bool = False) -> RestoreOutcome:
        return store.restore(
            "t1", A, state.owner_token, ttl_ms=3000, task_name="proj.task", call=CALL, attempt=1, takeovers=0,
            max_takeovers=3, renewal_age_ms=age_ms, lapsed=lapsed,
        )  # fmt: skip

    redis_client.delete(store.keys.lease("t1"))
    assert restore(3000) == RestoreOutcome.EXPIRED  # its TTL could have passed: another owner may hold it
    assert store.read("t1") is None
    assert restore(2000) == RestoreOutcome.RESTORED
    assert store.read("t1").status == LeaseStatus.RUNNING  # type: ignore[union-attr]
    redis_client.delete(store.keys.lease("t1"))
    assert restore(60_000, lapsed=True) == RestoreOutcome.RESTORED  # given up: for the reaper to re-send
    back = store.read("t1")
    assert back is not None and back.status == LeaseStatus.LAPSED
    # Due a TTL later: a newer owner whose lease vanished with it writes its own back first.
    assert back.lease_expire_at is not None and back.lease_expire_at >= server_ms(redis_client) + 2000
    (claimed,) = claim(store, "t1")
    assert claimed.code == "not-due"
    redis_client.hset(store.keys.lease("t1"), "leaseExpireAt", server_ms(redis_client) - 1)  # the TTL passed
    (claimed,) = claim(store, "t1")
    assert claimed.code == "requeued"


def _renew(token: int, owner: str) -> RenewRequest:
    return RenewRequest("t1", owner, token, 3000, ProgressReport())


def test_the_owner_that_handed_off_cannot_write_over_the_replacement(store: LeaseStore) -> None:
    # A late write of the token that handed off (a STARTED asked again, a SUCCESS after
    # replace()) is refused: stored, it would end the record and take the replacement's place.
    token = handed_off(store)
    for state, kind in (("SUCCESS", "ready"), ("STARTED", "other"), ("RETRY", "retry")):
        late = store.store("t1", token, meta(token, "p1/1/0", state), state=state, kind=kind, expires_ms=0, owner_id=A)
        assert (late.code, late.detail) == ("finished", "HANDED_OFF")
    assert store.client.get(store.keys.result("t1")) is None
    record = store.read("t1")
    assert record is not None and record.status == LeaseStatus.HANDED_OFF
    replacement = acquire(store, owner=C, call=NEW_CALL, publish_id="p1", handed_off_by=str(token))
    assert replacement.outcome == AcquireOutcome.NEW


# -- a hand-back: the replacement could not be sent --------------------------------------------------


def test_the_owner_takes_back_a_hand_off_whose_replacement_was_not_sent(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    token = handed_off(store)
    assert store.hand_back("t1", A, token, ttl_ms=30_000) == "ok"
    lease = store.read("t1")
    assert lease is not None and (lease.status, lease.owner_id, lease.owner_token) == (LeaseStatus.RUNNING, A, token)
    assert "handoffToken" not in lease.raw and "handoffPrior" not in lease.raw  # the original run had none
    assert redis_client.pttl(store.keys.lease("t1")) == -1
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) == lease.lease_expire_at
    # The owner's error is stored through the fence: the task ends as in Celery.
    failed = store.store("t1", token, meta(token, "p1/1/0", "FAILURE"), state="FAILURE", kind="ready", expires_ms=0)
    assert failed.stored
    assert acquire(store, owner=B, call=CALL, publish_id="p1").outcome == AcquireOutcome.DONE  # a late copy


def test_a_hand_back_once_the_replacement_started_or_by_another_token_takes_nothing(store: LeaseStore) -> None:
    token = handed_off(store)
    assert store.hand_back("t1", A, token - 1, ttl_ms=30_000) == "stale-token"
    assert store.hand_back("t1", B, token, ttl_ms=30_000) == "not-owner"
    replacement = acquire(store, owner=C, call=NEW_CALL, publish_id="p1", handed_off_by=str(token))
    assert store.hand_back("t1", A, token, ttl_ms=30_000) == "stale-token"
    lease = store.read("t1")
    assert lease is not None and (lease.owner_id, lease.owner_token) == (C, replacement.token)


def test_a_replacements_run_taken_back_keeps_the_hand_off_that_started_it(store: LeaseStore) -> None:
    first = handed_off(store)
    run = acquire(store, owner=B, call=NEW_CALL, publish_id="p1", handed_off_by=str(first))
    assert store.hand_off("t1", B, run.token, keep_ms=60_000) == "ok"
    assert store.hand_back("t1", B, run.token, ttl_ms=1) == "ok"
    lease = store.read("t1")
    assert lease is not None and lease.raw["handoffToken"] == str(first)
    # A copy of the message from before the first hand-off still does not run; once the lease
    # expired the reaper re-sends the replacement's own call, naming the hand-off.
    assert acquire(store, owner=C, call=CALL, publish_id="p1").outcome == AcquireOutcome.HANDED_OFF
    wait_for(lambda: store.server_time_ms() > (lease.lease_expire_at or 0))
    (claimed,) = claim(store, "t1")
    assert claimed.code == "requeued" and claimed.state is not None
    assert claimed.state.call == NEW_CALL and claimed.state.raw["handoffToken"] == str(first)


def lost_write(store: LeaseStore, writer: str) -> str:
    """The worker's main process: the process ``writer`` ("<host>/<pid>/") was lost (WorkerLostError)."""
    answer = store.store(
        "t1",
        None,
        b'{"status": "FAILURE"}',
        state="FAILURE",
        kind="ready",
        expires_ms=0,
        retry_due_ms=60_000,
        writer=writer,
        worker_lost=True,
    )
    return str(answer.code)


def test_the_process_that_handed_off_lost_before_its_replacement_started_is_taken_over(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # Killed between its hand-off and the send: no replacement may ever come.
    token = handed_off(store)
    assert lost_write(store, "host/9/") == "foreign"  # another process: the record stands
    assert lost_write(store, "host/1/") == "lapsed"  # the process that handed off
    [not_yet] = claim(store, "t1")
    assert not_yet.code == "not-due"  # the replacement may still be on its way
    redis_client.hset(store.keys.lease("t1"), "leaseExpireAt", store.server_time_ms() - 1)
    [result] = claim(store, "t1")
    assert result.code == "requeued" and result.cause == "gone" and result.state is not None
    assert result.state.raw["call"] and json.loads(result.state.raw["call"]) == CALL  # the replaced call
    assert "handoffToken" not in result.state.raw  # the hand-off undone
    # The re-sent original takes the task over; the replacement, had it been sent, is a copy.
    again = acquire(store, owner=B, publish_id="p1")
    assert again.outcome == AcquireOutcome.TAKEOVER and again.token > token
    late = acquire(store, owner=C, publish_id="p1", handed_off_by=str(token))
    assert late.outcome == AcquireOutcome.DUPLICATE


def test_a_replacement_received_after_its_process_was_lost_still_runs(store: LeaseStore) -> None:
    token = handed_off(store)
    assert lost_write(store, "host/1/") == "lapsed"
    started = acquire(store, owner=B, publish_id="p1", handed_off_by=str(token))
    assert started.outcome == AcquireOutcome.NEW  # the replacement's first start
    assert claim(store, "t1")[0].code == "not-due"  # its own lease now, not the lost record


#: The worker whose process handed off: one start of it (its liveness record's id).
WORKER = "host/100/start"


def unsent_hand_off(store: LeaseStore, redis_client: redis.Redis, alive_ms: int = 3_600_000) -> int:
    """A task run once under publish p1 and handed off by A, a process of WORKER, which has not
    said it sent the replacement yet: A's token. WORKER's liveness record holds ``alive_ms``."""
    store.liveness.worker_alive(WORKER, alive_ms)
    state = held(store, owner=A, call=CALL, publish_id="p1")
    assert store.hand_off("t1", A, state.owner_token, keep_ms=600_000, worker_id=WORKER) == "ok"
    return state.owner_token


def worker_lapses(store: LeaseStore, redis_client: redis.Redis) -> dict[str, int]:
    """WORKER's liveness record lapses (it was given 50 ms), and a reaper pass sees it."""
    wait_for(lambda: store.server_time_ms() > 60 + int(redis_client.zscore(store.keys.workers, WORKER) or 0))
    return store.liveness.lapse_dead_workers()


def test_a_hand_off_waits_under_its_live_worker_however_long_its_send_takes(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    unsent_hand_off(store, redis_client)
    filed = redis_client.zrange(store.keys.reserved_by(WORKER), 0, -1, withscores=True)
    assert [member for member, _ in filed] == [store.keys.lease("t1").encode()]
    assert filed[0][1] > store.server_time_ms() + 500_000  # filed as long as the record lives
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) is None  # nothing is due
    assert store.liveness.lapse_dead_workers() == {}
    record = store.read("t1")
    assert record is not None and record.status == LeaseStatus.HANDED_OFF and record.raw["handoffWorker"] == WORKER


def test_a_whole_worker_lost_between_its_hand_off_and_its_send_is_taken_over(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # Nobody writes WorkerLostError: the worker's liveness record lapses, and the reaper sees it.
    token = unsent_hand_off(store, redis_client, alive_ms=50)
    assert worker_lapses(store, redis_client) == {WORKER: 1}
    [result] = claim(store, "t1")
    assert result.code == "requeued" and result.cause == "gone" and result.state is not None
    assert json.loads(result.state.raw["call"]) == CALL and "handoffToken" not in result.state.raw
    assert "handoffWorker" not in result.state.raw and result.state.takeovers == 1
    assert not redis_client.exists(store.keys.reserved_by(WORKER))
    # The owner, had it lived on and sent after all, says so too late: nothing changes.
    assert store.replacement_sent("t1", A, token, worker_id=WORKER) == "finished"
    again = acquire(store, owner=B, publish_id="p1")
    assert again.outcome == AcquireOutcome.TAKEOVER and again.token > token
    assert store.replacement_sent("t1", A, token, worker_id=WORKER) == "stale-token"
    late = acquire(store, owner=C, publish_id="p1", handed_off_by=str(token))
    assert late.outcome == AcquireOutcome.DUPLICATE  # its replacement, come late, is a copy


def test_a_hand_off_said_sent_waits_for_its_replacement_whatever_becomes_of_its_worker(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    token = unsent_hand_off(store, redis_client, alive_ms=50)
    assert store.replacement_sent("t1", A, token, worker_id=WORKER) == "ok"
    assert store.replacement_sent("t1", A, token, worker_id=WORKER) == "ok"  # said again (a lost reply)
    assert redis_client.zscore(store.keys.reserved_by(WORKER), store.keys.lease("t1")) is None
    assert worker_lapses(store, redis_client) == {WORKER: 0}
    assert lost_write(store, "host/1/") == "foreign"  # Celery's WorkerLostError of the process: on its way
    assert claim(store, "t1")[0].code == "finished"
    started = acquire(store, owner=B, call=NEW_CALL, publish_id="p1", handed_off_by=str(token))
    assert started.outcome == AcquireOutcome.NEW
    assert {"handoffSent", "handoffWorker"}.isdisjoint(store.read("t1").raw)  # type: ignore[union-attr]


def test_a_lapsed_worker_leaves_a_replacement_that_started_and_a_later_hand_off_alone(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    token = unsent_hand_off(store, redis_client, alive_ms=50)
    started = acquire(store, owner=B, call=NEW_CALL, publish_id="p1", handed_off_by=str(token))
    assert started.outcome == AcquireOutcome.NEW
    assert store.replacement_sent("t1", A, token, worker_id=WORKER) == "stale-token"
    # The replacement's run hands off in turn, from another worker.
    assert store.hand_off("t1", B, started.token, keep_ms=600_000, worker_id="host/200/other") == "ok"
    assert worker_lapses(store, redis_client) == {WORKER: 0}
    record = store.read("t1")
    assert record is not None and record.status == LeaseStatus.HANDED_OFF and record.owner_token == started.token
    assert claim(store, "t1")[0].code == "finished"


# -- what the filing under the worker still misses ----------------------------------------------


@pytest.mark.parametrize(
    "state, put_back",
    [("FAILURE", False), ("FAILURE", True), ("REVOKED", False)],
    ids=["hard-time-limit", "hard-time-limit-message-put-back", "revoked-terminate"],
)
def test_a_handing_process_ended_by_its_worker_before_its_send_does_not_leave_the_task_waiting(
    store: LeaseStore, redis_client: redis.Redis, state: str, put_back: bool
) -> None:
    unsent_hand_off(store, redis_client)  # its worker lives on, for an hour
    exc = "TimeLimitExceeded" if state == "FAILURE" else "Terminated"
    meta_of_main = json.dumps({"status": state, "result": {"exc_type": exc, "exc_message": []}, "task_id": "t1"})
    answer = store.store(
        "t1",
        None,
        meta_of_main.encode(),
        state=state,
        kind="ready",
        expires_ms=0,
        retry_due_ms=60_000,
        writer="host/1/",  # the process that handed off, killed by its worker's main process
        put_back=put_back,
    )
    assert store.liveness.lapse_dead_workers() == {}
    ended = redis_client.get(store.keys.result("t1")) is not None
    due = redis_client.zscore(store.keys.index, store.keys.lease("t1")) is not None
    assert ended or due, f"the main process's {state} answered {answer.code}: the record waits for ever"


@pytest.mark.parametrize("then", ["replacement-received-first", "handed-back"])
def test_a_hand_off_leaves_its_workers_set_once_its_owner_is_done_with_it(
    store: LeaseStore, redis_client: redis.Redis, then: str
) -> None:
    store.liveness.worker_alive(WORKER, 3_600_000)
    token = held(store, owner=A, call=CALL, publish_id="p1").owner_token
    assert store.hand_off("t1", A, token, keep_ms=0, worker_id=WORKER) == "ok"  # no result expiry
    if then == "replacement-received-first":
        replacement = Reservation("t1", 5000, "proj.other", NEW_CALL, 3, publish_id="p1", handed_off_by=str(token))
        assert store.reserve_many([replacement], "w2@host", worker_id="w2@host/7/x") == ["reserved"]
        assert store.replacement_sent("t1", A, token, worker_id=WORKER) == "finished"
    else:
        assert store.hand_back("t1", A, token, ttl_ms=30_000, worker_id=WORKER) == "ok"
        failed = store.store("t1", token, meta(token, "p1/1/0", "FAILURE"), state="FAILURE", kind="ready", expires_ms=0)
        assert failed.stored
    # The worker's next reservations trim what is due in its set.
    later = Reservation("t2", 5000, "proj.task", CALL, 3, publish_id="q1")
    assert store.reserve_many([later], "host", worker_id=WORKER) == ["reserved"]
    assert redis_client.zscore(store.keys.reserved_by(WORKER), store.keys.lease("t1")) is None


def test_a_replacement_run_restored_before_its_hand_off_keeps_the_hand_off_that_started_it(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    first = handed_off(store)
    run = acquire(store, owner=B, call=NEW_CALL, publish_id="p1", handed_off_by=str(first))
    assert run.outcome == AcquireOutcome.NEW
    redis_client.delete(store.keys.lease("t1"))  # evicted
    restored = store.restore(
        "t1", B, run.token, ttl_ms=3000, task_name="proj.other", call=NEW_CALL, attempt=1, takeovers=0,
        max_takeovers=3, renewal_age_ms=0, publish_id="p1", handed_off_by=str(first),
    )  # fmt: skip
    assert restored == RestoreOutcome.RESTORED
    store.liveness.worker_alive(WORKER, 50)
    assert store.hand_off("t1", B, run.token, keep_ms=600_000, worker_id=WORKER) == "ok"
    assert worker_lapses(store, redis_client) == {WORKER: 1}  # lost before its send
    [claimed] = claim(store, "t1")
    assert claimed.code == "requeued" and claimed.state is not None and claimed.state.call == NEW_CALL
    copy = acquire(store, owner=C, call=CALL, publish_id="p1")  # a late copy of the first, replaced message
    assert copy.outcome == AcquireOutcome.HANDED_OFF
    assert claimed.state.raw.get("handoffToken") == str(first)


# -- a replacement said sent that never starts (the broker lost its message) ----------------------

REPLACEMENT = {"task": "proj.other", "args": [2], "kwargs": {}, "options": {"task_id": "t1", "queue": "later"}}


def recorded_hand_off(store: LeaseStore, worker_id: str | None = None) -> int:
    """As :func:`handed_off`, the replacement recorded with the record: A's token."""
    state = held(store, owner=A, call=CALL, publish_id="p1")
    code = store.hand_off(
        "t1", A, state.owner_token, keep_ms=60_000, worker_id=worker_id, replacement=json.dumps(REPLACEMENT)
    )
    assert code == "ok"
    return state.owner_token


def test_a_replacement_said_sent_and_not_started_is_sent_again_after_the_requeue_timeout(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    token = recorded_hand_off(store)
    assert store.replacement_sent("t1", A, token, due_in_ms=5000) == "ok"
    record = store.read("t1")
    assert record is not None and record.handoff_call == REPLACEMENT
    assert (record.lease_expire_at or 0) >= server_ms(redis_client) + 4000
    (claimed,) = claim(store, "t1", requeue=5000)
    assert claimed.code == "not-due"  # within the requeue timeout: its message is on its way
    redis_client.hset(store.keys.lease("t1"), "leaseExpireAt", server_ms(redis_client) - 1)  # the timeout passed
    (claimed,) = claim(store, "t1", requeue=5000)
    assert (claimed.code, claimed.cause) == ("requeued", "handoff")  # the reaper sends it again
    assert claimed.state is not None and claimed.state.handoff_call == REPLACEMENT
    again = store.read("t1")
    assert again is not None and again.status == LeaseStatus.HANDED_OFF  # never undone: no second run
    assert again.resends == 1 and redis_client.zscore(store.keys.index, store.keys.lease("t1")) is not None
    # Sent again at most max(maxTakeovers, 1) times; then only looked at after each timeout.
    for _ in range(2):
        redis_client.hset(store.keys.lease("t1"), "leaseExpireAt", server_ms(redis_client) - 1)
        assert claim(store, "t1", requeue=5000)[0].code == "requeued"
    redis_client.hset(store.keys.lease("t1"), "leaseExpireAt", server_ms(redis_client) - 1)
    assert claim(store, "t1", requeue=5000)[0].code == "waiting"
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) is not None  # nothing waits for ever
    # The replacement's message (a copy or the original) starts the task id, once.
    started = acquire(store, owner=C, call=NEW_CALL, publish_id="p1", handed_off_by=str(token))
    assert started.outcome == AcquireOutcome.NEW
    copy = acquire(store, owner=B, call=NEW_CALL, publish_id="p1", handed_off_by=str(token))
    assert copy.outcome == AcquireOutcome.DUPLICATE


def test_a_handing_process_lost_after_its_send_and_before_saying_so_is_not_run_again(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # Killed between Celery's publish and replacement_sent.lua (an OOM kill): its worker's
    # WorkerLostError makes the record due a requeue timeout later. The replacement may have
    # been sent, and may wait in a queue longer than that: the reaper sends the recorded
    # replacement again, the same message, and never undoes the hand-off (which ran the
    # replaced body again, and a canvas step with an id of its own twice).
    token = recorded_hand_off(store, worker_id=WORKER)
    lost = store.store(
        "t1", None, b'{"status": "FAILURE"}', state="FAILURE", kind="ready", expires_ms=0, writer="host/1/",
        worker_lost=True, retry_due_ms=5000,
    )  # fmt: skip
    assert lost.code == "lapsed"
    assert claim(store, "t1", requeue=5000)[0].code == "not-due"
    redis_client.hset(store.keys.lease("t1"), "leaseExpireAt", server_ms(redis_client) - 1)
    (claimed,) = claim(store, "t1", requeue=5000)
    assert (claimed.code, claimed.cause) == ("requeued", "handoff")
    record = store.read("t1")
    assert record is not None and record.status == LeaseStatus.HANDED_OFF and record.raw["handoffToken"] == str(token)
    copy = acquire(store, owner=B, call=CALL, publish_id="p1")  # the replaced message: never again
    assert copy.outcome == AcquireOutcome.HANDED_OFF
    started = acquire(store, owner=C, call=NEW_CALL, publish_id="p1", handed_off_by=str(token))
    assert started.outcome == AcquireOutcome.NEW
