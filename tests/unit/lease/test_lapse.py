"""lapse.lua and lapse_now.lua: an owner gives up a stalled lease; an operator makes one due now."""

from __future__ import annotations

import pytest

from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import acquire, claim, held, renew_req


def test_lapse_release_gives_the_lease_up_now(store: LeaseStore) -> None:
    state = held(store)
    assert store.lapse("t1", "host/1/a", state.owner_token, mode="release") == "ok"
    after = store.read("t1")
    assert after is not None and after.status == "LAPSED" and after.raw["lapseReason"] == "stalled"
    assert store.renew_many([renew_req(state)]) == ["lapsed"]
    assert store.lapse("t1", "host/1/a", state.owner_token, mode="release") == "not-running"


def test_lapse_expire_keeps_running_but_records_the_stall(store: LeaseStore) -> None:
    state = held(store)
    assert store.lapse("t1", "host/1/a", state.owner_token, mode="expire") == "ok"
    after = store.read("t1")
    assert after is not None and after.status == "RUNNING" and after.stalled_at is not None


def test_lapse_refuses_stale_and_foreign(store: LeaseStore) -> None:
    state = held(store)
    # A token older than the lease's (a newer one owns it); a newer one than the lease's
    # answers "missing": its lease was lost and an older one written since (test_restore.py).
    assert store.lapse("t1", "host/1/a", state.owner_token - 1, mode="release") == "stale-token"
    assert store.lapse("t1", "host/9/z", state.owner_token, mode="release") == "not-owner"
    assert store.lapse("nope", "host/1/a", 1, mode="release") == "missing"
    with pytest.raises(ValueError, match="mode"):
        store.lapse("t1", "host/1/a", state.owner_token, mode="later")


def test_lapse_now_keeps_a_live_owner_from_renewing_it_back(store: LeaseStore) -> None:
    state = held(store)
    assert store.lapse_now("t1") == "lapsed"
    assert store.renew_many([renew_req(state)]) == ["lapsed"]  # the owner is alive, but too late
    assert store.due_task_ids(10) == ["t1"]
    [result] = claim(store, "t1")
    assert result.code == "requeued" and result.cause == "gone"
    assert store.lapse_now("t1") == "not-live"
    assert store.lapse_now("t2") == "missing"


def test_lapse_now_of_a_lost_process_gives_up_only_a_lease_that_process_owns(store: LeaseStore) -> None:
    # The worker's main process lost host/1 (task_reject_on_worker_lost: Celery writes nothing).
    held(store, owner="host/1/a")
    assert store.lapse_now("t1", owner_prefix="host/2/") == "not-live"  # another process's lease
    held(store, "t2", owner="host/11/b")
    assert store.lapse_now("t2", owner_prefix="host/1/") == "not-live"  # a pid that only begins alike
    assert store.read("t1").status == "RUNNING"  # type: ignore[union-attr]
    assert store.lapse_now("t1", owner_prefix="host/1/") == "lapsed"
    after = store.read("t1")
    assert after is not None and after.status == "LAPSED" and after.raw["lapseReason"] == "worker-lost"
    [result] = claim(store, "t1")
    assert result.code == "requeued" and result.cause == "gone"


def test_lapse_unfinished_gives_the_lease_up_now_without_a_stall(store: LeaseStore) -> None:
    # A body that never finished (a cold shutdown, a SystemExit): due now, taken over as "gone".
    state = held(store)
    assert store.lapse("t1", "host/1/a", state.owner_token, mode="unfinished") == "ok"
    after = store.read("t1")
    assert after is not None and after.status == "LAPSED" and after.raw["lapseReason"] == "unfinished"
    assert after.stalled_at is None
    assert store.renew_many([renew_req(state)]) == ["lapsed"]
    assert store.lapse("t1", "host/1/a", state.owner_token, mode="unfinished") == "not-running"
    [result] = claim(store, "t1")
    assert result.code == "requeued" and result.cause == "gone"


def test_lapse_now_of_a_lost_process_that_celery_retries_waits_for_the_retry(store: LeaseStore) -> None:
    # Celery 5.7's retry_on_worker_lost: the main process sends a retry, then stores RETRY. The
    # lease waits for that retry from the start: a reaper pass before the RETRY write finds it
    # not due, and the retry's delivery takes it without counting a takeover.
    held(store, owner="host/1/a")
    assert store.lapse_now("t1", owner_prefix="host/2/", retry_due_ms=60_000) == "not-live"
    assert store.lapse_now("t1", owner_prefix="host/1/", retry_due_ms=60_000) == "retrying"
    after = store.read("t1")
    assert after is not None and after.status == "RETRYING"
    assert store.due_task_ids(10) == []
    [result] = claim(store, "t1")
    assert result.code == "not-due"
    retry = acquire(store, owner="host/2/b")
    assert (retry.outcome, retry.previous_status, retry.takeovers) == ("takeover", "RETRYING", 0)


def test_lapse_now_with_a_retry_due_needs_the_lost_process(store: LeaseStore) -> None:
    held(store)
    with pytest.raises(ValueError, match="owner_prefix"):
        store.lapse_now("t1", retry_due_ms=1000)
