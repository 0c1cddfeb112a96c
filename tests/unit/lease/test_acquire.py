"""acquire.lua: who runs a delivery, with which token; duplicates, finished tasks and races."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from celery_fenced._lease.state import AcquireOutcome
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import TTL, acquire, held, server_ms, wait_for


@pytest.mark.parametrize(("call", "publish_id"), [({"args": [1], "kwargs": {}}, "p1"), (None, "")])
def test_first_acquire_takes_token_and_writes_every_field(
    store: LeaseStore, redis_client: redis.Redis, call: dict[str, object] | None, publish_id: str
) -> None:
    """Both ways the script writes a first delivery: with a recorded call and a publish id (the
    common case, written out) and without them."""
    before = server_ms(redis_client)
    result = acquire(store, call=call, stage="start", publish_id=publish_id)
    assert result.outcome is AcquireOutcome.NEW
    assert (result.attempt, result.takeovers) == (1, 0)
    assert result.token > before * 1000  # a new counter starts from the server's clock, in µs
    # The answer carries only what a running owner needs: no recorded call, no status.
    assert set(result.state.raw) == {"ownerToken", "attempt", "takeovers"}
    state = store.read("t1")
    assert state is not None
    assert state.status == "RUNNING"
    assert state.owner_id == "host/1/a"
    assert state.owner_token == result.token
    assert state.attempt == 1
    assert state.takeovers == 0
    assert state.current_stage == "start"
    assert state.progress_version == 0
    assert state.task_name == "proj.task"
    assert state.call == call
    assert state.lease_expire_at is not None and before + TTL <= state.lease_expire_at <= before + TTL + 1000
    assert redis_client.ttl(store.keys.lease("t1")) == -1  # no TTL while live
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) == state.lease_expire_at
    assert state.raw["heartbeatAt"] == state.raw["lastProgressAt"]
    assert set(state.raw) == {
        "status",
        "ownerId",
        "ownerToken",
        "currentStage",
        "progressVersion",
        "heartbeatAt",
        "lastProgressAt",
        "leaseExpireAt",
        "leaseTtl",
        "attempt",
        "takeovers",
        "taskName",
        "maxTakeovers",
        "primary",
        *(("call", "publishId") if publish_id else ()),
    }
    assert state.raw.get("publishId") == (publish_id or None)
    assert state.raw["primary"] == redis_client.info("replication")["master_replid"]  # the server it was taken on


def test_live_lease_makes_a_second_delivery_a_duplicate(store: LeaseStore) -> None:
    acquire(store)
    second = acquire(store, owner="host/2/b")
    assert second.outcome is AcquireOutcome.DUPLICATE
    assert not second.outcome.runs
    assert second.state.owner_id == "host/1/a"


def test_expired_lease_is_taken_over_with_a_higher_token(store: LeaseStore) -> None:
    first = acquire(store, ttl=50)
    lease = store.read("t1")
    assert lease is not None
    wait_for(lambda: store.server_time_ms() > (lease.lease_expire_at or 0))
    second = acquire(store, owner="host/2/b")
    assert second.outcome is AcquireOutcome.TAKEOVER
    assert second.previous_status == "RUNNING"
    assert second.state.owner_token > first.state.owner_token
    assert second.state.attempt == 2


@pytest.mark.parametrize("status", ["LAPSED", "REQUEUED", "RETRYING"])
def test_given_up_leases_are_taken_over(store: LeaseStore, redis_client: redis.Redis, status: str) -> None:
    first = acquire(store)
    redis_client.hset(store.keys.lease("t1"), "status", status)
    second = acquire(store, owner="host/2/b")
    assert second.outcome is AcquireOutcome.TAKEOVER
    assert second.previous_status == status
    assert second.state.owner_token > first.state.owner_token


@pytest.mark.parametrize(
    ("status", "outcome"), [("DONE", AcquireOutcome.DONE), ("ABANDONED", AcquireOutcome.ABANDONED)]
)
def test_finished_tasks_do_not_run_again(
    store: LeaseStore, redis_client: redis.Redis, status: str, outcome: AcquireOutcome
) -> None:
    acquire(store)
    redis_client.hset(store.keys.lease("t1"), "status", status)
    assert acquire(store, owner="host/2/b").outcome is outcome


def test_twenty_threads_racing_acquire_have_one_winner(store: LeaseStore) -> None:
    for round_no in range(5):
        task_id = f"race-{round_no}"
        barrier = threading.Barrier(20)

        def contend(i: int, task_id: str = task_id, barrier: threading.Barrier = barrier):  # type: ignore[no-untyped-def]
            barrier.wait()
            return acquire(store, task_id=task_id, owner=f"host/{i}/x")

        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(contend, range(20)))
        winners = [r for r in results if r.outcome.runs]
        assert len(winners) == 1
        assert all(r.outcome is AcquireOutcome.DUPLICATE for r in results if not r.outcome.runs)


def test_tokens_are_globally_monotonic_across_task_ids_and_lost_leases(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    tokens = [held(store, task_id=f"m{i}").owner_token for i in range(5)]
    redis_client.delete(store.keys.lease("m0"))  # a lost (evicted) lease hash
    tokens.append(held(store, task_id="m0").owner_token)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert redis_client.ttl(store.keys.token) == -1


def test_an_acquire_asked_again_by_the_same_attempt_gets_the_same_answer(store: LeaseStore) -> None:
    first = acquire(store, owner="host/1/a")
    again = acquire(store, owner="host/1/a")
    assert first.outcome is AcquireOutcome.NEW and again.outcome is AcquireOutcome.NEW
    assert again.state.owner_token == first.state.owner_token
    assert acquire(store, owner="host/2/b").outcome is AcquireOutcome.DUPLICATE  # another attempt is still refused


def test_a_token_counter_moved_back_never_hands_out_a_held_token_again(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    state = held(store, ttl=30)
    redis_client.set(store.keys.token, 0)  # the counter lost its last writes; the lease did not
    wait_for(lambda: store.server_time_ms() > (state.lease_expire_at or 0))
    taken = acquire(store, owner="host/2/b")
    assert taken.outcome is AcquireOutcome.TAKEOVER and taken.state.owner_token > state.owner_token
    late = store.store("t1", state.owner_token, b"late", state="SUCCESS", kind="ready", expires_ms=0)
    assert late.code == "stale"


def test_an_equal_token_of_another_owner_is_not_current(store: LeaseStore) -> None:
    state = held(store, owner="host/1/a")
    other = store.store("t1", state.owner_token, b"x", state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/9/z")
    assert other.code == "stale"
    mine = store.store("t1", state.owner_token, b"ok", state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/1/a")
    assert mine.stored


def test_a_finished_task_id_applied_again_runs_again_but_a_copy_of_its_run_does_not(store: LeaseStore) -> None:
    first = held(store, publish_id="p1")
    store.store("t1", first.owner_token, b"one", state="SUCCESS", kind="ready", expires_ms=0)
    assert acquire(store, owner="host/2/b", publish_id="p1").outcome is AcquireOutcome.DONE  # a copy
    assert acquire(store, owner="host/2/b").outcome is AcquireOutcome.DONE  # no publish id: a copy
    again = acquire(store, owner="host/3/c", publish_id="p2")  # the task id applied again
    assert again.outcome is AcquireOutcome.NEW and again.state.owner_token > first.owner_token
    after = store.read("t1")
    assert after is not None and after.status == "RUNNING" and after.takeovers == 0
    assert after.raw["publishId"] == "p2" and "resultState" not in after.raw


def test_a_cancelled_task_id_is_not_run_again_by_another_publish(store: LeaseStore) -> None:
    acquire(store, publish_id="p1")
    assert store.cancel("t1", lambda token: b"revoked", expires_ms=0).code == "cancelled"
    assert acquire(store, owner="host/2/b", publish_id="p2").outcome is AcquireOutcome.DONE


def test_scripts_are_loaded_again_after_the_server_forgot_them(store: LeaseStore, redis_client: redis.Redis) -> None:
    assert acquire(store).outcome is AcquireOutcome.NEW
    redis_client.script_flush()  # as after a Redis restart
    assert acquire(store, task_id="t2").outcome is AcquireOutcome.NEW
    assert redis_client.script_exists(store.scripts.acquire.sha) == [True]


def test_after_a_flushdb_an_acquire_takes_a_token_above_every_earlier_one(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    earlier = [acquire(store, f"t{n}").token for n in range(3)]
    redis_client.flushdb()  # the counter and its epoch go with the leases
    again = acquire(store, "t1", owner="host/2/b")  # the same task: a new owner fences the same rows
    assert again.outcome is AcquireOutcome.NEW
    assert again.token > max(earlier)


CALL = {"task": "proj.task", "args": [1], "kwargs": {}, "options": {}}
HEAD = '{"status": "STARTED", "result": {"pid": 7, "hostname": "w1@h"}, "task_id": "t1"'


def test_a_run_that_takes_the_lease_stores_its_started_result_in_the_same_call(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # task_track_started: the STARTED Celery writes next is stored by the acquire itself, with
    # the run's token as its fence_token, as the fenced backend's own write would store it.
    first = acquire(store, call=CALL, publish_id="p1", started_head=HEAD, started_expires_ms=60_000)
    assert first.outcome == AcquireOutcome.NEW
    stored = redis_client.get(store.keys.result("t1"))
    assert stored == f'{HEAD}, "fence_token": {first.token}}}'.encode()
    assert 0 < redis_client.pttl(store.keys.result("t1")) <= 60_000
    # A copy that does not run writes nothing; a takeover stores its own STARTED.
    assert acquire(store, owner="host/2/b", started_head=HEAD).outcome == AcquireOutcome.DUPLICATE
    assert redis_client.get(store.keys.result("t1")) == stored
    redis_client.hset(store.keys.lease("t1"), "leaseExpireAt", server_ms(redis_client) - 1)
    taken = acquire(store, owner="host/2/b", started_head=HEAD)
    assert taken.outcome == AcquireOutcome.TAKEOVER
    assert redis_client.get(store.keys.result("t1")) == f'{HEAD}, "fence_token": {taken.token}}}'.encode()
    assert redis_client.pttl(store.keys.result("t1")) == -1  # no expiry asked


def test_a_started_result_is_never_stored_over_a_success_celery_keeps(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    first = held(store, call=CALL, publish_id="p1")
    done = f'{{"status": "SUCCESS", "result": 1, "task_id": "t1", "fence_run": "p1/1/0", "fence_token": {first.owner_token}}}'
    assert store.store("t1", first.owner_token, done, state="SUCCESS", kind="ready", expires_ms=0).stored
    again = acquire(store, owner="host/2/b", call=CALL, publish_id="p2", started_head=HEAD)  # applied again
    assert again.outcome == AcquireOutcome.NEW
    assert redis_client.get(store.keys.result("t1")) == done.encode()
