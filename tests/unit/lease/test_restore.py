"""restore.lua: a live owner writes back the lease the store lost (FLUSHDB, a restart without
persistence, a failover that lost writes, an eviction); a thawed owner never does, and between
two owners the newer token wins."""

from __future__ import annotations

import pytest
import redis

from celery_fenced._lease.state import LeaseState, LeaseStatus, Reservation, RestoreOutcome, StoreOutcome
from celery_fenced._lease.store import LeaseStore
from tests.unit.lease.helpers import TTL, acquire, claim, held, renew_req, server_ms, wait_for

A, B = "host/1/a", "host/2/b"
CALL = {"task": "proj.task", "args": [], "kwargs": {}, "options": {}}


def restore(store: LeaseStore, owner: str, token: int, age_ms: int, *, lapsed: bool = False) -> RestoreOutcome:
    return store.restore(
        "t1", owner, token, ttl_ms=TTL, task_name="proj.task", call=CALL, attempt=1, takeovers=0,
        max_takeovers=3, renewal_age_ms=age_ms, lapsed=lapsed,
    )  # fmt: skip


def taken_over(store: LeaseStore) -> tuple[LeaseState, LeaseState]:
    """A (the first owner) froze; its lease expired and B took the task over."""
    acquire(store, owner=A, ttl=50, call=CALL)
    first = store.read("t1")
    assert first is not None
    wait_for(lambda: store.server_time_ms() > (first.lease_expire_at or 0))
    second = held(store, owner=B, call=CALL)
    assert second.owner_token > first.owner_token
    return first, second


def test_a_thawed_owners_lapsed_write_back_is_due_a_ttl_later_and_the_newer_owner_replaces_it(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    a, b = taken_over(store)
    redis_client.flushdb()  # the lease store lost everything: leases, tokens, the index
    assert restore(store, A, a.owner_token, TTL + 5000) == RestoreOutcome.EXPIRED  # thawed: never back
    # A gave its lease up on its own clock and found it gone: written back for the reaper...
    assert restore(store, A, a.owner_token, TTL + 5000, lapsed=True) == RestoreOutcome.RESTORED
    written = store.read("t1")
    assert written is not None and written.status == LeaseStatus.LAPSED
    assert (written.lease_expire_at or 0) >= server_ms(redis_client) + TTL - 1000
    assert claim(store, "t1")[0].code == "not-due"  # ...but not re-sent before a live owner is back
    # B, live, renews: the older token's lease answers as a missing one, and B writes its own back.
    assert store.renew_many([renew_req(b, B)]) == ["missing"]
    assert restore(store, B, b.owner_token, 1000) == RestoreOutcome.RESTORED
    back = store.read("t1")
    assert back is not None and back.status == LeaseStatus.RUNNING and back.owner_token == b.owner_token
    assert store.renew_many([renew_req(b, B)]) == ["ok"]
    # Written back first, B's lease is never replaced by A's lapsed write-back.
    assert restore(store, A, a.owner_token, TTL + 5000, lapsed=True) == RestoreOutcome.EXISTS
    assert store.read("t1").owner_token == b.owner_token  # type: ignore[union-attr]


def test_a_copy_received_after_a_flush_does_not_keep_the_owner_from_its_lease(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    b = held(store, owner=B, call=CALL)
    redis_client.flushdb()
    # A copy of the task's message is received (reserved, no token) before B's next renewal.
    copy = Reservation("t1", 60_000, "proj.task", CALL, 3, "", "")
    assert store.reserve_many([copy], "worker-2") == ["reserved"]
    assert store.renew_many([renew_req(b, B)]) == ["missing"]
    assert restore(store, B, b.owner_token, 1000) == RestoreOutcome.RESTORED
    back = store.read("t1")
    assert back is not None and back.status == LeaseStatus.RUNNING and back.owner_token == b.owner_token
    assert acquire(store, owner="host/3/c", call=CALL).outcome == "duplicate"  # the copy does not run


def test_a_newer_owner_past_its_ttl_does_not_replace_an_older_tokens_lease(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    a, b = taken_over(store)
    redis_client.flushdb()
    assert restore(store, A, a.owner_token, TTL + 5000, lapsed=True) == RestoreOutcome.RESTORED
    assert restore(store, B, b.owner_token, TTL) == RestoreOutcome.EXPIRED  # B froze too: it may have lost
    assert store.read("t1").owner_token == a.owner_token  # type: ignore[union-attr]


@pytest.mark.parametrize("in_its_place", ["an older owner's write-back", "a copy's reservation"])
def test_a_newer_owner_ending_its_lease_before_its_next_renewal_takes_it_back_first(
    store: LeaseStore, redis_client: redis.Redis, in_its_place: str
) -> None:
    """After a loss, an older token's lease (a thawed owner's write-back given up) or a
    reservation (a copy received) stands where the current owner B's vanished. B's result
    write, hand-off, lapse and release made before its next renewal answer as its renewal
    does: ``missing`` (not ``stale``: B is the newer owner), so B writes its lease back over
    it (the newer token wins) and ends it. Refused as stale, B lost its task: nothing stored,
    and the task ran again from the older owner's write-back a TTL later."""
    a, b = taken_over(store)
    redis_client.flushdb()
    if in_its_place == "a copy's reservation":
        copy = Reservation("t1", 60_000, "proj.task", CALL, 3, "", "")
        assert store.reserve_many([copy], "worker-2") == ["reserved"]
    else:
        assert restore(store, A, a.owner_token, TTL + 5000, lapsed=True) == RestoreOutcome.RESTORED
    meta = b'{"status": "SUCCESS", "result": 1}'
    write = store.store("t1", b.owner_token, meta, state="SUCCESS", kind="ready", expires_ms=0, owner_id=B)
    assert write.code == StoreOutcome.MISSING
    assert store.hand_off("t1", B, b.owner_token) == "missing"
    assert store.lapse("t1", B, b.owner_token, mode="release") == "missing"
    assert store.release("t1", B, b.owner_token, status=LeaseStatus.DONE) == "missing"
    assert store.read("t1").owner_token != b.owner_token  # type: ignore[union-attr]  # nothing written
    assert restore(store, B, b.owner_token, 1000) == RestoreOutcome.RESTORED
    written = store.store("t1", b.owner_token, meta, state="SUCCESS", kind="ready", expires_ms=0, owner_id=B)
    assert written.code == StoreOutcome.STORED
    assert redis_client.get(store.keys.result("t1")) == meta
    # The older owner, thawed, still gets nothing: its write is stale against B's result.
    late = store.store("t1", a.owner_token, b"late", state="SUCCESS", kind="ready", expires_ms=0, owner_id=A)
    assert late.code != StoreOutcome.STORED
