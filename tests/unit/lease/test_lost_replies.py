"""A script whose reply is lost (the connection cut after the server ran it) is run again by
the client's retry: it must answer as it did the first time, or what the caller does on that
answer (the side effects of an abandon or a cancel) never happens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.store import LeaseStore
from tests.support.lossy_proxy import ReplyDroppingProxy
from tests.support.redis_server import RedisServer
from tests.unit.lease.helpers import abandoned_meta, acquire, wait_for


def evalsha(sha: str) -> bytes:
    """The bytes of an EVALSHA of ``sha`` (not a SCRIPT EXISTS or LOAD of it), as RESP sends them."""
    return b"EVALSHA\r\n$40\r\n" + sha.encode()


@pytest.fixture
def proxy(any_redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[ReplyDroppingProxy]:
    proxy = ReplyDroppingProxy(any_redis_server.port).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def lossy_store(proxy: ReplyDroppingProxy, keys: KeySpace) -> Iterator[LeaseStore]:
    """A store whose client reaches Redis through the proxy, with redis-py's default retries (before redis-py 6, none for a pipeline)."""
    client = redis.Redis(host="127.0.0.1", port=proxy.port)
    store = LeaseStore(client, keys)
    yield store
    store.close()
    client.close()


def test_an_abandon_whose_reply_is_lost_is_answered_abandoned_again(
    lossy_store: LeaseStore, proxy: ReplyDroppingProxy
) -> None:
    acquire(lossy_store, max_takeovers=0, ttl=50)
    wait_for(lambda: lossy_store.due_task_ids(10) == ["t1"])
    lossy_store.claim_due(["t0"], grace_ms=0, requeue_ms=60_000, abandoned_meta=abandoned_meta, expires_ms=0)  # loaded
    proxy.drop_reply_to(evalsha(lossy_store.scripts.claim.sha))
    [result] = lossy_store.claim_due(["t1"], grace_ms=0, requeue_ms=60_000, abandoned_meta=abandoned_meta, expires_ms=0)
    assert proxy.dropped == 1  # the server ran the claim; its reply was lost, and the claim sent again
    # The reaper runs the abandon's side effects (chord part, chain, errbacks) on this answer.
    assert result.code == "abandoned" and result.state is not None and result.state.status == "ABANDONED"


def test_a_cancel_whose_reply_is_lost_is_answered_cancelled_again(
    lossy_store: LeaseStore, proxy: ReplyDroppingProxy
) -> None:
    acquire(lossy_store)
    revoked = lambda token: f'{{"status": "REVOKED", "fence_token": {token}}}'.encode()  # noqa: E731
    assert lossy_store.cancel("t0", revoked, expires_ms=0).code == "unknown"  # the script loaded
    proxy.drop_reply_to(evalsha(lossy_store.scripts.cancel.sha))
    result = lossy_store.cancel("t1", revoked, expires_ms=0)
    assert proxy.dropped == 1
    # control.cancel runs a cancelled task's side effects (its chord part) on this answer.
    assert result.code == "cancelled", result


def test_a_requeue_whose_reply_is_lost_is_answered_requeued_again(
    lossy_store: LeaseStore, proxy: ReplyDroppingProxy
) -> None:
    acquire(lossy_store, ttl=50)
    wait_for(lambda: lossy_store.due_task_ids(10) == ["t1"])
    lossy_store.claim_due(["t0"], grace_ms=0, requeue_ms=60_000, abandoned_meta=abandoned_meta, expires_ms=0)  # loaded
    proxy.drop_reply_to(evalsha(lossy_store.scripts.claim.sha))
    [result] = lossy_store.claim_due(["t1"], grace_ms=0, requeue_ms=60_000, abandoned_meta=abandoned_meta, expires_ms=0)
    assert proxy.dropped == 1
    # The reaper re-sends the task on this answer (else only after the requeue timeout).
    assert result.code == "requeued" and result.cause == "gone"
    # Another claim (another pass, another reaper: its own token) is not the same claim.
    [other] = lossy_store.claim_due(["t1"], grace_ms=0, requeue_ms=60_000, abandoned_meta=abandoned_meta, expires_ms=0)
    assert other.code == "not-due"


def test_an_acquire_and_a_result_write_whose_replies_are_lost_are_answered_as_the_first_time(
    lossy_store: LeaseStore, proxy: ReplyDroppingProxy, redis_client: redis.Redis
) -> None:
    acquire(lossy_store, "t0")  # loaded
    proxy.drop_reply_to(evalsha(lossy_store.scripts.acquire.sha))
    first = acquire(
        lossy_store, "t1", call={"task": "proj.task", "args": [], "kwargs": {}, "options": {}}, publish_id="p1"
    )
    assert proxy.dropped == 1
    assert first.outcome.value == "new" and first.outcome.runs and first.attempt == 1
    state = lossy_store.read("t1")
    assert state is not None and state.owner_token == first.token and state.owner_id == "host/1/a"
    lossy_store.store("t0", 1, b"x", state="STARTED", kind="other", expires_ms=0)  # loaded
    meta = f'{{"status": "SUCCESS", "result": 1, "fence_run": "p1/1/0", "fence_token": {first.token}}}'.encode()
    proxy.drop_reply_to(evalsha(lossy_store.scripts.store.sha))
    stored = lossy_store.store(
        "t1", first.token, meta, state="SUCCESS", kind="ready", expires_ms=0, owner_id="host/1/a"
    )
    assert proxy.dropped == 2
    # Celery's side effects of the write (chord part, chain, callbacks) run on "stored".
    assert (stored.code, stored.detail) == ("stored", "DONE")
    assert redis_client.get(lossy_store.keys.result("t1")) == meta


def test_a_write_back_whose_reply_is_lost_is_answered_restored_again(
    lossy_store: LeaseStore, proxy: ReplyDroppingProxy, redis_client: redis.Redis
) -> None:
    first = acquire(lossy_store, "t1")
    redis_client.delete(lossy_store.keys.lease("t1"))  # vanished (an eviction, a failover)

    def restore() -> str:
        return str(
            lossy_store.restore(
                "t1",
                "host/1/a",
                first.token,
                ttl_ms=3000,
                task_name="proj.task",
                call=None,
                attempt=1,
                takeovers=0,
                max_takeovers=3,
                renewal_age_ms=100,
            )
        )

    assert (
        lossy_store.restore(
            "t0",
            "host/1/a",
            1,
            ttl_ms=3000,
            task_name="proj.task",
            call=None,
            attempt=1,
            takeovers=0,
            max_takeovers=3,
            renewal_age_ms=100,
        )
        == "restored"
    )  # loaded
    proxy.drop_reply_to(evalsha(lossy_store.scripts.restore.sha))
    # The heartbeat gives up a lease whose write-back answers anything but "restored".
    assert restore() == "restored"
    assert proxy.dropped == 1
    state = lossy_store.read("t1")
    assert state is not None and state.status == "RUNNING" and state.owner_token == first.token
    assert (
        lossy_store.restore(
            "t1",
            "host/2/b",
            first.token,
            ttl_ms=3000,
            task_name="proj.task",
            call=None,
            attempt=1,
            takeovers=0,
            max_takeovers=3,
            renewal_age_ms=100,
        )
        == "exists"
    )
