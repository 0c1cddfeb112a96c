"""The checkpoint: details an owner publishes (renew, lapse, release) and the next acquire hands on."""

from __future__ import annotations

import pytest
import redis

from celery_fenced._lease.state import AcquireOutcome, Checkpoint, LeaseStatus, ProgressReport
from celery_fenced._lease.store import LeaseStore
from celery_fenced._task.details import encode_details
from tests.unit.lease.helpers import acquire, held, renew_req

A, B, C = "host/1/a", "host/2/b", "host/3/c"


def publish(store: LeaseStore, state, owner: str, version: int, stage: str = "process", **details) -> None:  # type: ignore[no-untyped-def]
    text = "" if not details else encode_details(details)
    assert store.renew_many([renew_req(state, owner, stage=stage, progress_version=version, details=text)]) == ["ok"]


def give_up(redis_client: redis.Redis, store: LeaseStore) -> None:
    redis_client.hset(store.keys.lease("t1"), "status", "LAPSED")


def test_a_first_attempt_has_no_checkpoint(store: LeaseStore) -> None:
    assert acquire(store).checkpoint is None


def test_a_takeover_gets_the_stage_and_details_the_previous_owner_published(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    first = held(store, owner=A)
    publish(store, first, A, 3, done=6, name="rapport é", ratio=0.1)
    assert store.read("t1").details == {"done": 6, "name": "rapport é", "ratio": 0.1}  # type: ignore[union-attr]
    give_up(redis_client, store)
    second = acquire(store, owner=B)
    assert second.outcome is AcquireOutcome.TAKEOVER
    assert second.checkpoint == Checkpoint(
        "process", {"done": 6, "name": "rapport é", "ratio": 0.1}, 1, first.owner_token
    )


def test_an_owner_that_published_nothing_passes_on_the_checkpoint_it_was_given(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    first = held(store, owner=A)
    publish(store, first, A, 1, done=6)
    give_up(redis_client, store)
    second = acquire(store, owner=B)
    give_up(redis_client, store)  # the second owner stalled before its first progress
    third = acquire(store, owner=C)
    assert third.checkpoint == second.checkpoint == Checkpoint("process", {"done": 6}, 1, first.owner_token)


def test_the_next_owners_own_progress_becomes_the_next_checkpoint(store: LeaseStore, redis_client: redis.Redis) -> None:
    first = held(store, owner=A)
    publish(store, first, A, 1, done=6)
    give_up(redis_client, store)
    second = held(store, owner=B)
    publish(store, second, B, 2, stage="save", done=10)
    give_up(redis_client, store)
    assert acquire(store, owner=C).checkpoint == Checkpoint("save", {"done": 10}, 2, second.owner_token)


def test_progress_without_stage_or_details_gives_a_checkpoint_of_none_and_empty(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    first = held(store, owner=A)
    publish(store, first, A, 1, stage="")
    give_up(redis_client, store)
    assert acquire(store, owner=B).checkpoint == Checkpoint(None, {}, 1, first.owner_token)


def test_a_stale_token_never_writes_details(store: LeaseStore, redis_client: redis.Redis) -> None:
    first = held(store, owner=A)
    publish(store, first, A, 1, done=6)
    give_up(redis_client, store)
    second = held(store, owner=B)
    publish(store, second, B, 1, done=7)
    zombie = renew_req(first, A, stage="process", progress_version=9, details=encode_details({"done": 1}))
    assert store.renew_many([zombie]) == ["stale-token"]
    zombie_progress = ProgressReport("process", 9, 0, encode_details({"done": 1}))
    assert store.lapse("t1", A, first.owner_token, mode="release", progress=zombie_progress) == "stale-token"
    assert store.release("t1", A, first.owner_token, status=LeaseStatus.DONE, progress=zombie_progress) == "stale-token"
    assert store.read("t1").details == {"done": 7}  # type: ignore[union-attr]


def test_a_stall_release_publishes_the_owners_last_details(store: LeaseStore) -> None:
    first = held(store, owner=A)
    publish(store, first, A, 1, done=5)
    progress = ProgressReport("process", 2, 0, encode_details({"done": 6}))
    assert store.lapse("t1", A, first.owner_token, mode="release", progress=progress) == "ok"
    assert acquire(store, owner=B).checkpoint == Checkpoint("process", {"done": 6}, 1, first.owner_token)


@pytest.mark.parametrize("status", [LeaseStatus.RETRYING, LeaseStatus.REQUEUED])
def test_an_attempt_that_waits_to_run_again_publishes_its_last_details(store: LeaseStore, status: LeaseStatus) -> None:
    first = held(store, owner=A)
    progress = ProgressReport("fetch", 4, 0, encode_details({"page": 3}))
    assert store.release("t1", A, first.owner_token, status=status, progress=progress) == "ok"
    after = store.read("t1")
    assert after is not None and after.details == {"page": 3} and after.current_stage == "fetch"
    assert acquire(store, owner=B).checkpoint == Checkpoint("fetch", {"page": 3}, 1, first.owner_token)


def test_an_attempt_that_ends_without_a_result_leaves_only_a_tombstone(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    first = held(store, owner=A)
    progress = ProgressReport("fetch", 4, 0, encode_details({"page": 3}))
    assert store.release("t1", A, first.owner_token, status=LeaseStatus.DONE, progress=progress) == "ok"
    kept = {k.decode() for k in redis_client.hkeys(store.keys.lease("t1"))}
    assert kept == {"status", "ownerId", "ownerToken", "attempt", "takeovers", "taskName", "finishedAt"}
    assert redis_client.object("encoding", store.keys.lease("t1")) in (b"listpack", b"ziplist")
    assert acquire(store, owner=B).outcome == "done"


def test_the_same_attempt_asking_again_gets_the_same_checkpoint(store: LeaseStore, redis_client: redis.Redis) -> None:
    first = held(store, owner=A)
    publish(store, first, A, 1, done=6)
    give_up(redis_client, store)
    taken = acquire(store, owner=B)
    again = acquire(store, owner=B)
    assert again.outcome is AcquireOutcome.TAKEOVER and again.checkpoint == taken.checkpoint is not None


def test_the_task_id_applied_again_starts_without_the_earlier_runs_checkpoint(store: LeaseStore) -> None:
    first = held(store, owner=A, publish_id="p1")
    publish(store, first, A, 1, done=6)
    store.store("t1", first.owner_token, b"one", state="SUCCESS", kind="ready", expires_ms=0)
    again = acquire(store, owner=B, publish_id="p2")
    assert again.outcome is AcquireOutcome.NEW and again.checkpoint is None
    assert store.read("t1").details == {}  # type: ignore[union-attr]


def test_a_progress_version_that_moves_back_still_writes_newer_details(store: LeaseStore) -> None:
    # The heartbeat reads the details before the version: details given by a progress() call
    # whose version the renewal missed are written all the same.
    first = held(store, owner=A)
    publish(store, first, A, 5, done=1)
    publish(store, first, A, 5, done=2)
    after = store.read("t1")
    assert after is not None and after.details == {"done": 2} and after.progress_version == 5
