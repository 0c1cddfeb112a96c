"""claim.lua: the reaper's claims: causes, grace, re-sends, abandoning, and concurrent reapers."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import redis

from celery_fenced._lease.state import AcquireOutcome
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import abandoned_meta, acquire, claim, held, renew_req, wait_for


def test_claim_leaves_live_leases_and_rescored_index(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = held(store)
    [result] = claim(store, "t1")
    assert result.code == "not-due"
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) == state.lease_expire_at


def test_claim_of_expired_lease_requeues_with_cause_gone(store: LeaseStore) -> None:
    state = held(store, ttl=30)
    wait_for(lambda: store.server_time_ms() > (state.lease_expire_at or 0))
    assert store.due_task_ids(10) == ["t1"]
    [result] = claim(store)
    assert result.code == "requeued" and result.cause == "gone"
    assert result.state is not None and result.state.status == "REQUEUED" and result.state.takeovers == 1
    assert store.renew_many([renew_req(state)]) == ["claimed"]


def test_claim_of_lapsed_lease_has_cause_stalled_and_grace_delays_it(store: LeaseStore) -> None:
    state = held(store)
    store.lapse("t1", "host/1/a", state.owner_token, mode="release")
    assert claim(store, "t1", grace=60_000)[0].code == "not-due"
    [result] = claim(store, "t1")
    assert result.code == "requeued" and result.cause == "stalled"


def test_expire_mode_stall_is_counted_as_stalled(store: LeaseStore) -> None:
    state = held(store, ttl=30)
    store.lapse("t1", "host/1/a", state.owner_token, mode="expire")
    wait_for(lambda: store.server_time_ms() > (state.lease_expire_at or 0))
    assert claim(store, "t1")[0].cause == "stalled"


def test_requeued_task_not_acquired_in_time_is_sent_again(store: LeaseStore) -> None:
    state = held(store)
    store.lapse("t1", "host/1/a", state.owner_token, mode="release")
    assert claim(store, "t1", requeue=30)[0].code == "requeued"
    wait_for(lambda: store.server_time_ms() > (store.read("t1").lease_expire_at or 0))  # type: ignore[union-attr]
    [again] = claim(store, "t1")
    assert again.code == "requeued" and again.cause == "resend"
    assert again.state.takeovers == 1 and again.state.raw["resends"] == "1"  # type: ignore[union-attr]


def test_a_backlog_is_sent_again_a_bounded_number_of_times_and_never_abandoned(store: LeaseStore) -> None:
    state = held(store, max_takeovers=2)
    store.lapse("t1", "host/1/a", state.owner_token, mode="release")
    codes = []
    for _ in range(5):  # nobody acquires: the messages wait in a long queue
        codes.append(claim(store, "t1", requeue=20)[0].code)
        wait_for(lambda: store.server_time_ms() > (store.read("t1").lease_expire_at or 0))  # type: ignore[union-attr]
    assert codes == ["requeued", "requeued", "requeued", "waiting", "waiting"]
    after = store.read("t1")
    assert after is not None and after.status == "REQUEUED" and after.takeovers == 1
    assert acquire(store, owner="host/2/b").outcome is AcquireOutcome.TAKEOVER  # a queued copy starts at last


def test_takeovers_past_the_maximum_abandon_with_a_fenced_failure(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = held(store, max_takeovers=1)
    store.lapse("t1", "host/1/a", state.owner_token, mode="release")
    assert claim(store, "t1")[0].code == "requeued"
    again = held(store, owner="host/2/b", max_takeovers=1)
    store.lapse("t1", "host/2/b", again.owner_token, mode="release")
    [result] = claim(store, "t1")
    assert result.code == "abandoned" and result.state is not None
    assert result.state.status == "ABANDONED" and result.state.owner_token > again.owner_token
    stored = redis_client.get(store.keys.result("t1"))
    assert stored == abandoned_meta("t1", result.state.owner_token)
    assert acquire(store, owner="host/3/c").outcome is AcquireOutcome.ABANDONED
    late = store.store("t1", again.owner_token, b"late", state="SUCCESS", kind="ready", expires_ms=0)
    assert late.code == "stale"


def test_claim_cleans_index_entries_of_finished_and_missing_leases(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    state = held(store)
    store.store("t1", state.owner_token, b"ok", state="SUCCESS", kind="ready", expires_ms=0)
    redis_client.zadd(store.keys.index, {store.keys.lease("t1"): 0, store.keys.lease("ghost"): 0})
    results = {r.task_id: r.code for r in claim(store)}
    assert results == {"t1": "finished", "ghost": "missing"}
    assert redis_client.zcard(store.keys.index) == 0


def test_concurrent_claims_requeue_each_task_once(store: LeaseStore) -> None:
    for round_no in range(5):
        task_id = f"c{round_no}"
        state = held(store, task_id=task_id)
        store.lapse(task_id, "host/1/a", state.owner_token, mode="release")
        barrier = threading.Barrier(20)

        def contend(_: int, task_id: str = task_id, barrier: threading.Barrier = barrier) -> str:
            barrier.wait()
            return claim(store, task_id)[0].code

        with ThreadPoolExecutor(20) as pool:
            codes = list(pool.map(contend, range(20)))
        assert codes.count("requeued") == 1
        assert set(codes) <= {"requeued", "not-due"}
        assert store.read(task_id).takeovers == 1  # type: ignore[union-attr]


def test_tokens_strictly_increase_through_claim_and_acquire_races(store: LeaseStore) -> None:
    seen = []
    state = held(store)
    seen.append(state.owner_token)
    for round_no in range(5):
        store.lapse("t1", state.owner_id, state.owner_token, mode="release")
        claim(store, "t1")
        barrier = threading.Barrier(20)

        def contend(i: int, barrier: threading.Barrier = barrier, round_no: int = round_no):  # type: ignore[no-untyped-def]
            barrier.wait()
            return acquire(store, owner=f"host/{round_no}/{i}", max_takeovers=100)

        with ThreadPoolExecutor(20) as pool:
            winners = [r for r in pool.map(contend, range(20)) if r.outcome.runs]
        assert len(winners) == 1
        state = winners[0].state
        seen.append(state.owner_token)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
