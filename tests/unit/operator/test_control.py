"""The operator's actions on one task (control.py): cancel, redrive, the dead letters, inspect."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from typing import Any

from celery import Celery

from celery_fenced import reap
from celery_fenced._lease.state import StoreOutcome
from celery_fenced._operator import control
from celery_fenced._reaper.reaper import REAP_COMMAND
from tests.unit.conftest import queued

CALL = {"task": "proj.report", "args": [7], "kwargs": {}, "options": {}}


def running(app: Celery, task_id: str, max_takeovers: int = 3) -> Any:
    store = app.backend.lease_store
    return store.acquire(
        task_id, "host/1/a", ttl_ms=60_000, task_name="proj.report", max_takeovers=max_takeovers, call=CALL
    )


def stored(app: Celery, task_id: str) -> dict[str, Any]:
    meta: dict[str, Any] = app.backend.get_task_meta(task_id)
    return meta


def test_cancel_stores_a_revoked_result_newer_than_the_owner_and_refuses_its_writes(fenced_app: Celery) -> None:
    owner = running(fenced_app, "c1").state
    assert control.cancel(fenced_app, "c1", "not needed") == "cancelled"
    meta = stored(fenced_app, "c1")
    assert meta["status"] == "REVOKED" and "not needed" in str(meta["result"])
    assert meta["fence_token"] > owner.owner_token
    late = fenced_app.backend.lease_store.store(
        "c1", owner.owner_token, b"{}", state="SUCCESS", kind="ready", expires_ms=0
    )
    assert late.code == StoreOutcome.STALE
    assert control.cancel(fenced_app, "c1") == "finished"  # asked again: nothing changes
    assert stored(fenced_app, "c1")["fence_token"] == meta["fence_token"]


def test_cancel_of_an_unknown_id_stores_nothing_unless_forced(fenced_app: Celery) -> None:
    assert control.cancel(fenced_app, "typo") == "unknown"
    assert stored(fenced_app, "typo")["status"] == "PENDING"
    assert control.cancel(fenced_app, "queued", unknown_too=True) == "cancelled"
    assert stored(fenced_app, "queued")["status"] == "REVOKED"


@contextlib.contextmanager
def worker_pidbox(app: Celery, hostname: str) -> Iterator[Callable[[], list[str]]]:
    """A worker's control mailbox on the real broker: yields what it heard, drained on each call."""
    heard: list[str] = []
    with app.connection_for_write() as connection:
        channel = connection.channel()
        handlers = {REAP_COMMAND: lambda state, **_: heard.append(REAP_COMMAND)}
        node = app.control.mailbox.Node(hostname, state=None, channel=channel, handlers=handlers)
        consumer = node.listen()

        def drain() -> list[str]:
            with contextlib.suppress(socket.timeout, TimeoutError):
                while True:
                    connection.drain_events(timeout=0.3)
            return list(heard)

        drain()  # subscribed before anything is sent
        try:
            yield drain
        finally:
            consumer.cancel()
            channel.close()


def test_redrive_puts_an_abandoned_task_back_and_asks_the_live_workers_for_a_reap(fenced_app: Celery) -> None:
    store = fenced_app.backend.lease_store
    owner = running(fenced_app, "a1", max_takeovers=0).state
    store.lapse("a1", "host/1/a", owner.owner_token, mode="release")
    assert reap(fenced_app).abandoned == ["a1"]
    assert [state.task_id for state in control.abandoned(fenced_app)] == ["a1"]
    store.liveness.worker_alive("w1@host/42/abcd", ttl_ms=60_000)
    with worker_pidbox(fenced_app, "w1@host") as heard:
        assert control.redrive(fenced_app, "a1") == "redriven"
        assert store.read("a1").status == "LAPSED"  # type: ignore[union-attr]
        # A control message to the live worker, not a task message in a queue.
        assert heard() == [REAP_COMMAND]
        assert queued(fenced_app) == []
        assert control.abandoned(fenced_app) == []
        assert control.redrive_many(fenced_app, ["a1", "nothing"]) == {"a1": "not-abandoned", "nothing": "missing"}
        assert heard() == [REAP_COMMAND]  # nothing redriven: no reap asked


def test_the_dead_letters_forget_a_task_whose_lease_is_gone(fenced_app: Celery) -> None:
    store = fenced_app.backend.lease_store
    for task_id in ("d1", "d2"):
        owner = running(fenced_app, task_id, max_takeovers=0).state
        store.lapse(task_id, "host/1/a", owner.owner_token, mode="release")
    assert reap(fenced_app).abandoned == ["d1", "d2"]
    fenced_app.backend.client.delete(store.keys.lease("d1"))
    assert [state.task_id for state in control.abandoned(fenced_app)] == ["d2"]
    assert store.abandoned_task_ids(10) == ["d2"]


def test_inspect_reads_the_lease_or_says_there_is_none(fenced_app: Celery) -> None:
    owner = running(fenced_app, "i1").state
    state = control.inspect(fenced_app, "i1")
    assert state is not None and state.owner_token == owner.owner_token and state.call == CALL
    assert control.inspect(fenced_app, "nothing") is None
