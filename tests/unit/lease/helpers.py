"""What the store's tests share: short calls of the scripts, and the server's clock."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from celery_fenced._lease.state import LeaseState, ProgressReport, RenewRequest
from celery_fenced._lease.store import LeaseStore

__all__ = ["TTL", "abandoned_meta", "acquire", "claim", "held", "renew_req", "server_ms", "wait_for"]

TTL = 3000


def acquire(store: LeaseStore, task_id: str = "t1", owner: str = "host/1/a", ttl: int = TTL, **kw):  # type: ignore[no-untyped-def]
    return store.acquire(
        task_id, owner, ttl_ms=ttl, task_name="proj.task", max_takeovers=kw.pop("max_takeovers", 3), **kw
    )


def held(store: LeaseStore, task_id: str = "t1", owner: str = "host/1/a", ttl: int = TTL, **kw) -> LeaseState:  # type: ignore[no-untyped-def]
    """Acquire, then the lease as stored (the answer of a first delivery carries only the token)."""
    acquire(store, task_id, owner, ttl, **kw)
    state = store.read(task_id)
    assert state is not None
    return state


def server_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def renew_req(  # type: ignore[no-untyped-def]
    state,
    owner: str = "host/1/a",
    *,
    stage: str = "",
    progress_version: int = 0,
    progress_age_ms: int = 0,
    details: str = "",
    **kw,
):
    values = dict(task_id=state.task_id, owner_id=owner, token=state.owner_token, ttl_ms=TTL)
    values.update(kw)
    progress = ProgressReport(stage, progress_version, progress_age_ms, details)
    return RenewRequest(progress=progress, **values)


def abandoned_meta(task_id: str, token: int) -> bytes:
    return f'{{"status": "FAILURE", "fence_token": {token}}}'.encode()


def claim(store: LeaseStore, *task_ids: str, grace: int = 0, requeue: int = 60_000):  # type: ignore[no-untyped-def]
    ids = list(task_ids) or store.due_task_ids(100)
    return store.claim_due(ids, grace_ms=grace, requeue_ms=requeue, abandoned_meta=abandoned_meta, expires_ms=0)
