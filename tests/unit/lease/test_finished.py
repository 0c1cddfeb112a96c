"""A finished lease's compact form: an owner's READY result carries the fence, the lease goes.

Each test would fail without it: the lease hash stays (with its call and progress) where the
result carries the fence, or a late write, a redelivery or a zombie's write-back goes through
where the result alone must refuse it.
"""

from __future__ import annotations

import json

import pytest
import redis

from celery_fenced._lease.finished import FENCE_RUN, fence_of, run_text
from celery_fenced._lease.state import AcquireOutcome, LeaseStatus, ProgressReport, Reservation, RestoreOutcome
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import claim, held

A, B = "host/1/a", "host/2/b"
CALL = {"task": "proj.task", "args": [1], "kwargs": {}, "options": {"queue": "celery"}}


def meta(token: int, status: str = "SUCCESS", *, run: str | None = "p1/1/0", result: object = None) -> bytes:
    """A meta as the fenced backend encodes it (Celery's JSON: ", " and ": " separators)."""
    fields: dict[str, object] = {"status": status, "result": result or {"rows": 1}, "task_id": "t1"}
    if run is not None:
        fields[FENCE_RUN] = run
    fields["fence_token"] = token
    return json.dumps(fields).encode()


def finish(store: LeaseStore, token: int, value: bytes, *, expires_ms: int = 60_000) -> str:
    outcome = store.store("t1", token, value, state="SUCCESS", kind="ready", expires_ms=expires_ms, owner_id=A)
    return f"{outcome.code}:{outcome.detail}"


def test_an_owners_ready_result_ends_its_lease_into_the_result(store: LeaseStore, redis_client: redis.Redis) -> None:
    first = held(store, owner=A, call=CALL, publish_id="p1")
    assert redis_client.exists(store.keys.lease("t1"))
    assert finish(store, first.owner_token, meta(first.owner_token)) == "stored:DONE"
    assert not redis_client.exists(store.keys.lease("t1"))  # no hash, no call, no progress kept
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) is None
    state = store.read("t1")
    assert state is not None
    assert (state.status, state.owner_token, state.attempt, state.takeovers) == ("DONE", first.owner_token, 1, 0)
    assert state.raw["resultState"] == "SUCCESS" and state.raw["publishId"] == "p1"


def test_the_result_refuses_a_late_write_of_an_older_owner(store: LeaseStore, redis_client: redis.Redis) -> None:
    old = held(store, owner=A, ttl=1)
    store.lapse_now("t1")
    new = store.acquire("t1", B, ttl_ms=60_000, task_name="proj.task", max_takeovers=3, publish_id="p1")
    assert new.outcome == AcquireOutcome.TAKEOVER
    done = meta(new.token, run="p1/2/0")
    outcome = store.store("t1", new.token, done, state="SUCCESS", kind="ready", expires_ms=60_000, owner_id=B)
    assert outcome.stored and not redis_client.exists(store.keys.lease("t1"))
    late = store.store("t1", old.owner_token, meta(old.owner_token), state="SUCCESS", kind="ready", expires_ms=0)
    assert (late.code, late.detail) == ("stale", str(new.token))
    late_failure = store.store("t1", old.owner_token, b"boom", state="FAILURE", kind="ready", expires_ms=0)
    assert late_failure.code == "stale"
    assert redis_client.get(store.keys.result("t1")) == done
    assert store.read("t1").attempt == 2  # type: ignore[union-attr]


def test_the_finishing_writer_asking_again_gets_the_same_answer(store: LeaseStore, redis_client: redis.Redis) -> None:
    first = held(store, owner=A, publish_id="p1")
    value = meta(first.owner_token)
    assert finish(store, first.owner_token, value) == "stored:DONE"
    assert finish(store, first.owner_token, value) == "stored:DONE"  # its reply was lost
    assert finish(store, first.owner_token, meta(first.owner_token, result={"other": 2})) == "finished:DONE"
    assert redis_client.get(store.keys.result("t1")) == value


@pytest.mark.parametrize("worker_lost", [False, True])
def test_a_tokenless_write_after_the_end_is_refused(
    store: LeaseStore, redis_client: redis.Redis, worker_lost: bool
) -> None:
    first = held(store, owner=A, publish_id="p1")
    value = meta(first.owner_token)
    finish(store, first.owner_token, value)
    late = store.store(
        "t1", None, b"revoked", state="FAILURE" if worker_lost else "REVOKED", kind="ready", expires_ms=0,
        writer="host/1/", worker_lost=worker_lost,
    )  # fmt: skip
    assert late.code == "finished"
    assert redis_client.get(store.keys.result("t1")) == value and not redis_client.exists(store.keys.lease("t1"))


@pytest.mark.parametrize("publish_id", ["p1", ""])
def test_a_redelivery_of_the_finished_run_does_not_run(
    store: LeaseStore, redis_client: redis.Redis, publish_id: str
) -> None:
    first = held(store, owner=A, call=CALL, publish_id="p1")
    finish(store, first.owner_token, meta(first.owner_token))
    again = store.acquire("t1", B, ttl_ms=60_000, task_name="proj.task", max_takeovers=3, publish_id=publish_id)
    assert again.outcome == AcquireOutcome.DONE
    assert again.state.owner_token == first.owner_token and again.state.status == LeaseStatus.DONE
    assert not redis_client.exists(store.keys.lease("t1"))  # the compact form stays compact


def test_another_publish_of_the_task_id_runs_again_and_keeps_the_success(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    first = held(store, owner=A, call=CALL, publish_id="p1")
    value = meta(first.owner_token)
    finish(store, first.owner_token, value)
    rerun = store.acquire("t1", B, ttl_ms=60_000, task_name="proj.task", max_takeovers=3, call=CALL, publish_id="p2")
    assert rerun.outcome == AcquireOutcome.NEW and rerun.token > first.owner_token
    assert rerun.attempt == 2
    kept = store.store(
        "t1", rerun.token, meta(rerun.token, run="p2/2/0"), state="SUCCESS", kind="ready", expires_ms=60_000,
        owner_id=B,
    )  # fmt: skip
    assert (kept.code, kept.detail) == ("sticky", "kept")  # Celery keeps the first SUCCESS
    assert redis_client.get(store.keys.result("t1")) == value
    # That run's end is a tombstone: a redelivery of its message does not run it again.
    duplicate = store.acquire("t1", A, ttl_ms=60_000, task_name="proj.task", max_takeovers=3, publish_id="p2")
    assert duplicate.outcome == AcquireOutcome.DONE


def test_a_zombie_never_writes_back_the_lease_of_a_finished_task(store: LeaseStore, redis_client: redis.Redis) -> None:
    old = held(store, owner=A, ttl=1, call=CALL)
    store.lapse_now("t1")
    new = store.acquire("t1", B, ttl_ms=60_000, task_name="proj.task", max_takeovers=3, publish_id="p1")
    store.store("t1", new.token, meta(new.token, run="p1/2/0"), state="SUCCESS", kind="ready", expires_ms=0, owner_id=B)

    def write_back(owner: str, token: int) -> RestoreOutcome:
        return store.restore(
            "t1",
            owner,
            token,
            ttl_ms=60_000,
            task_name="proj.task",
            call=CALL,
            attempt=1,
            takeovers=0,
            max_takeovers=3,
            renewal_age_ms=0,
        )

    assert write_back(A, old.owner_token) == RestoreOutcome.STALE_TOKEN  # the zombie's heartbeat
    assert write_back(B, new.token) == RestoreOutcome.FINISHED  # the finisher's, racing its own end
    assert not redis_client.exists(store.keys.lease("t1"))
    late = store.store("t1", old.owner_token, meta(old.owner_token), state="SUCCESS", kind="ready", expires_ms=0)
    assert late.code == "stale"


@pytest.mark.parametrize("ending", ["cancel", "no-run"])
def test_a_result_fenced_without_its_run_still_fences_once_its_lease_hash_is_lost(
    store: LeaseStore, redis_client: redis.Redis, ending: str
) -> None:
    # A cancel's REVOKED (and an abandoned task's FAILURE, and a result whose run cannot be
    # carried) ends with only "fence_token": its DONE hash stands beside it. An evicted or lost
    # hash must not let the owner the cancel ended write its lease back, or its result over it.
    owner = held(store, owner=A, call=CALL, publish_id="p1")
    if ending == "cancel":

        def revoked(token: int) -> bytes:
            return meta(token, status="REVOKED", run=None)

        assert store.cancel("t1", revoked, expires_ms=0).code == "cancelled"
    else:
        assert finish(store, owner.owner_token, meta(owner.owner_token, status="FAILURE", run=None)) == "stored:DONE"
    ended = redis_client.get(store.keys.result("t1"))
    fence = fence_of(ended)
    assert fence is not None and fence.token >= owner.owner_token and fence.publish_id == ""
    redis_client.delete(store.keys.lease("t1"))  # evicted, or lost with a failover
    write_back = store.restore(
        "t1",
        A,
        owner.owner_token,
        ttl_ms=60_000,
        task_name="proj.task",
        call=CALL,
        attempt=1,
        takeovers=0,
        max_takeovers=3,
        renewal_age_ms=0,
    )
    assert write_back == (RestoreOutcome.STALE_TOKEN if ending == "cancel" else RestoreOutcome.FINISHED)
    late = store.store("t1", owner.owner_token, meta(owner.owner_token), state="SUCCESS", kind="ready", expires_ms=0)
    assert late.code == ("stale" if ending == "cancel" else "finished")
    assert redis_client.get(store.keys.result("t1")) == ended
    again = store.acquire("t1", B, ttl_ms=60_000, task_name="proj.task", max_takeovers=3, publish_id="p1")
    assert not again.outcome.runs  # a copy of the message does not run the ended task
    assert store.read("t1").status == "DONE"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "value",
    [b"\x80\x04pickled", meta(1, run=None), b'{"status": "SUCCESS", "fence_token": 1}'],
    ids=["not-json", "no-run", "no-run-json"],
)
def test_a_result_that_cannot_carry_the_fence_leaves_a_small_tombstone(
    store: LeaseStore, redis_client: redis.Redis, value: bytes
) -> None:
    first = held(store, owner=A, call=CALL, publish_id="p1")
    assert finish(store, first.owner_token, value, expires_ms=60_000) == "stored:DONE"
    lease = store.keys.lease("t1")
    fields = {k.decode() for k in redis_client.hkeys(lease)}
    assert fields == {
        *("status", "ownerId", "ownerToken", "attempt", "takeovers"),
        *("publishId", "taskName", "finishedAt", "resultState"),
    }
    assert redis_client.object("encoding", lease) in (b"listpack", b"ziplist")
    assert 0 < redis_client.pttl(lease) <= redis_client.pttl(store.keys.result("t1")) + 1000
    late = store.store("t1", first.owner_token, b"late", state="SUCCESS", kind="ready", expires_ms=0, owner_id=A)
    assert late.code == "finished"
    assert redis_client.get(store.keys.result("t1")) == value


def test_a_progress_report_is_never_read_from_a_result() -> None:
    # The tail only: a user's result holding the same words earlier is not a fence.
    inner = json.dumps({"status": "SUCCESS", "result": {"fence_run": "x/1/0", "fence_token": 9}, "task_id": "t"})
    assert fence_of(inner) is None
    assert fence_of(meta(7, status="STARTED")) is None  # not READY
    assert fence_of(meta(7)).token == 7  # type: ignore[union-attr]


def test_a_publish_id_that_json_would_escape_is_not_carried() -> None:
    assert run_text("abc123", 2, 1) == "abc123/2/1"
    assert run_text('a"b', 1, 0) is None and run_text("x" * 65, 1, 0) is None


def test_progress_fields_and_details_go_with_the_lease(store: LeaseStore, redis_client: redis.Redis) -> None:
    first = held(store, owner=A, call=CALL, publish_id="p1")
    from celery_fenced._lease.state import RenewRequest

    report = ProgressReport("load", 1, 0, json.dumps({"rows": 10}))
    assert store.renew_many([RenewRequest("t1", A, first.owner_token, 60_000, report)]) == ["ok"]
    finish(store, first.owner_token, meta(first.owner_token))
    assert redis_client.keys("*t1*") == [store.keys.result("t1").encode()]


def test_an_owner_whose_task_was_claimed_meanwhile_leaves_a_tombstone(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # Given up, claimed (a takeover counted, the message re-sent), and then the owner,
    # whose token is still the current one, finishes first: the result's run says 0
    # takeovers, the lease 1, so the lease stays, as a tombstone saying so.
    first = held(store, owner=A, call=CALL, publish_id="p1")
    assert store.lapse_now("t1") == "lapsed"
    claim(store, "t1")
    assert store.read("t1").takeovers == 1  # type: ignore[union-attr]
    assert finish(store, first.owner_token, meta(first.owner_token, run="p1/1/0")) == "stored:DONE"
    state = store.read("t1")
    assert state is not None and (state.status, state.takeovers) == ("DONE", 1)
    assert redis_client.object("encoding", store.keys.lease("t1")) in (b"listpack", b"ziplist")


def test_a_copy_received_after_the_end_is_not_reserved(store: LeaseStore, redis_client: redis.Redis) -> None:
    # A prefetched copy of a finished task (a re-send raced its end) must not bring back a
    # RESERVED lease, which the next acquire would run again.
    first = held(store, owner=A, call=CALL, publish_id="p1")
    finish(store, first.owner_token, meta(first.owner_token))
    late_copy = Reservation("t1", 60_000, "proj.task", CALL, 3, publish_id="p1")
    fresh = Reservation("t2", 60_000, "proj.task", CALL, 3, publish_id="p2")
    assert store.reserve_many([late_copy, fresh], "w1@host") == ["left", "reserved"]
    assert not redis_client.exists(store.keys.lease("t1"))
    assert store.acquire("t1", B, ttl_ms=60_000, task_name="proj.task", max_takeovers=3, publish_id="p1").outcome == (
        AcquireOutcome.DONE
    )
