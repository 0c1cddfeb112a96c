"""reserve.lua and lapse_reserved.lua: a received message is reserved until it starts; a dropped one is sent again."""

from __future__ import annotations

import redis

from celery_fenced._lease.state import Reservation
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import acquire, claim, held, server_ms

CALL = {"task": "proj.task", "args": [1], "kwargs": {}, "options": {}}


def reservation(task_id: str = "t1", expires_in_ms: int = 60_000, max_takeovers: int = 3) -> Reservation:
    return Reservation(task_id, expires_in_ms, "proj.task", CALL, max_takeovers, publish_id="p1")


def test_a_received_message_is_reserved_with_its_call_until_its_start_timeout(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    before = server_ms(redis_client)
    assert store.reserve_many([reservation(expires_in_ms=5000)], "w1@host") == ["reserved"]
    state = store.read("t1")
    assert state is not None and state.status == "RESERVED" and state.reserved_by == "w1@host"
    assert state.call == {"task": "proj.task", "args": [1], "kwargs": {}, "options": {}}
    assert state.lease_expire_at is not None and before + 5000 <= state.lease_expire_at <= before + 6000
    assert state.attempt == 0 and state.takeovers == 0
    assert redis_client.zscore(store.keys.index, store.keys.lease("t1")) == state.lease_expire_at


def test_its_start_is_a_first_start_on_any_worker(store: LeaseStore) -> None:
    store.reserve_many([reservation()], "w1@host")
    result = acquire(store, owner="w2@host/1/a")
    assert result.outcome == "new" and result.previous_status == ""
    state = store.read("t1")
    assert state is not None and state.status == "RUNNING" and state.attempt == 1
    assert "reservedBy" not in state.raw


def test_a_live_finished_retrying_or_lapsed_lease_is_left_alone(store: LeaseStore) -> None:
    running = held(store, "running")
    assert running is not None
    done = held(store, "done")
    store.store("done", done.owner_token, b"{}", state="SUCCESS", kind="ready", expires_ms=0)
    lapsed = held(store, "lapsed")
    store.lapse("lapsed", "host/1/a", lapsed.owner_token, mode="release")
    codes = store.reserve_many([reservation(task_id) for task_id in ("running", "done", "lapsed")], "w1@host")
    assert codes == ["left", "left", "left"]
    assert [store.read(t).status for t in ("running", "done", "lapsed")] == ["RUNNING", "DONE", "LAPSED"]  # type: ignore[union-attr]


def test_an_expired_reservation_is_sent_again_as_unstarted_and_never_counted(store: LeaseStore) -> None:
    store.reserve_many([reservation(expires_in_ms=0, max_takeovers=0)], "w1@host")
    (result,) = claim(store, "t1")
    assert (result.code, result.cause) == ("requeued", "unstarted")
    state = store.read("t1")
    assert state is not None and state.status == "REQUEUED" and state.takeovers == 0
    # The re-sent copy is received again, and expires again: again a re-send, never abandoned.
    assert store.reserve_many([reservation(expires_in_ms=0, max_takeovers=0)], "w2@host") == ["reserved"]
    (again,) = claim(store, "t1")
    assert (again.code, again.cause) == ("requeued", "unstarted")


def test_a_reservation_not_yet_expired_is_not_claimed(store: LeaseStore) -> None:
    store.reserve_many([reservation(expires_in_ms=60_000)], "w1@host")
    (result,) = claim(store, "t1")
    assert result.code == "not-due"


def test_a_reservation_after_a_takeover_starts_as_a_takeover(store: LeaseStore) -> None:
    first = held(store)
    store.lapse("t1", "host/1/a", first.owner_token, mode="release")
    claim(store, "t1")  # REQUEUED, re-sent
    assert store.reserve_many([reservation()], "w2@host") == ["reserved"]
    again = acquire(store, owner="w2@host/1/b")
    assert again.outcome == "takeover" and again.state.attempt == 2


def test_a_reconnecting_worker_makes_only_its_own_reservations_due(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    store.reserve_many([reservation("a"), reservation("b")], "w1@host")
    store.reserve_many([reservation("b")], "w2@host")  # b was received again by another worker
    acquire(store, "c")
    assert store.lapse_reserved(["a", "b", "c", "missing"], "w1@host") == 1
    now = server_ms(redis_client)
    assert store.read("a").lease_expire_at <= now  # type: ignore[union-attr, operator]
    assert store.read("b").lease_expire_at > now  # type: ignore[union-attr, operator]
    assert store.lapse_reserved([], "w1@host") == 0
    (result,) = claim(store, "a")
    assert (result.code, result.cause) == ("requeued", "unstarted")


def test_the_first_start_of_a_task_sent_again_unstarted_is_no_takeover(store: LeaseStore) -> None:
    store.reserve_many([reservation(expires_in_ms=0)], "w1@host")
    claim(store, "t1")  # REQUEUED, cause unstarted
    result = acquire(store, owner="w1@host/1/a")  # the copy w1 held starts after all
    assert result.outcome == "new" and result.state.attempt == 1 and result.state.takeovers == 0


def test_a_request_that_ended_leaves_its_workers_reservations(store: LeaseStore, redis_client: redis.Redis) -> None:
    """unreserve.lua: only the entries named leave; the leases are left as they are."""
    store.reserve_many([reservation("a"), reservation("b"), reservation("c")], "w1@host", "w1@host/1/x")
    acquire(store, "a")  # started
    assert store.unreserve(["a", "b", "missing"], "w1@host/1/x") == 2
    members = redis_client.zrange(store.keys.reserved_by("w1@host/1/x"), 0, -1)
    assert members == [store.keys.lease("c").encode()]
    assert store.read("b").status == "RESERVED"  # type: ignore[union-attr]
    assert store.unreserve([], "w1@host/1/x") == 0


def test_dropped_reservations_leave_their_workers_reservations(store: LeaseStore, redis_client: redis.Redis) -> None:
    store.reserve_many([reservation("a"), reservation("b")], "w1@host", "w1@host/1/x")
    store.reserve_many([reservation("b")], "w2@host", "w2@host/1/y")  # received again elsewhere
    assert store.lapse_reserved(["a", "b"], "w1@host", "w1@host/1/x") == 1
    assert redis_client.zcard(store.keys.reserved_by("w1@host/1/x")) == 0
    assert redis_client.zcard(store.keys.reserved_by("w2@host/1/y")) == 1


def test_the_replacements_reservation_leaves_nothing_to_the_owner_that_handed_off(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    # The hand-off's record becomes the replacement's reservation: the owner that handed off
    # keeps no hold on it (no write, end or second hand-off of its lands), and its word that it
    # sent the replacement answers that no hand-off of its token waits any more.
    owner = held(store, owner="host/1/a", call=CALL, publish_id="p1")
    assert store.hand_off("t1", "host/1/a", owner.owner_token, keep_ms=0) == "ok"
    replacement = Reservation(
        "t1", 60_000, "proj.other", CALL, 3, publish_id="p1", handed_off_by=str(owner.owner_token)
    )
    assert store.reserve_many([replacement], "w2") == ["reserved"]
    assert store.replacement_sent("t1", "host/1/a", owner.owner_token) == "finished"
    late = store.store(
        "t1", owner.owner_token, b"late", state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/1/a"
    )
    assert not late.stored
    assert store.hand_off("t1", "host/1/a", owner.owner_token, keep_ms=0) == "not-owner"
    assert redis_client.get(store.keys.result("t1")) is None
    assert store.read("t1").status == "RESERVED"  # type: ignore[union-attr]
