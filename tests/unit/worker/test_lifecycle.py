"""The life of an attempt's lease in a worker process: the heartbeat (one per app and process,
never inherited through fork), and what a delivery run by Celery's own tracer writes through
the fence its request carries: a retry's due time, a lost owner's late result, a skipped
delivery."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.trace import build_tracer

from celery_fenced import ProgressLeasedTask
from celery_fenced._lease.state import StoreResult
from celery_fenced._task.running import current_lease, set_current_lease
from celery_fenced._telemetry import events
from celery_fenced._worker import hooks
from celery_fenced._worker.lifecycle import heartbeat_for, stop_heartbeats
from celery_fenced._worker.runtime import runtime_of


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("heartbeats", set_as_current=False)
    yield app
    stop_heartbeats()
    app.close()


def test_one_heartbeat_per_app_in_a_process(app: Celery) -> None:
    other = Celery("other", set_as_current=False)
    assert heartbeat_for(app, create=False) is None
    first = heartbeat_for(app)
    assert first is not None
    assert heartbeat_for(app) is first
    assert heartbeat_for(other) is not first
    other.close()


def test_a_forked_child_makes_its_own_heartbeat(app: Celery) -> None:
    parent = heartbeat_for(app)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, as a prefork pool process starts
        try:
            inherited = heartbeat_for(app, create=False)
            own = heartbeat_for(app)
            os.write(write, b"own" if inherited is None and own is not None and own is not parent else b"inherited")
        finally:
            os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 64)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert answer == b"own"
    assert heartbeat_for(app) is parent  # the parent keeps its own


# -- deliveries run by Celery's tracer, as a pool process runs them ------------------------------


@pytest.fixture
def traced(fenced_app: Celery) -> Iterator[Celery]:
    """The unit app, its fenced tasks run by Celery's tracer in this thread (prerun, body,
    result writes, postrun); the process's heartbeat stopped after the test."""
    yield fenced_app
    set_current_lease(None)  # an attempt a test began and did not end is not the next test's
    runtime = runtime_of(fenced_app, create=False)
    if runtime is not None:
        runtime.stop()


def _run(app: Celery, task: Any, task_id: str, retries: int = 0) -> Any:
    """Run one delivery of ``task`` under ``task_id`` as a worker's pool process does
    (``retries``: Celery's count of the retries before it)."""
    message = {
        "id": task_id,
        "task": task.name,
        "hostname": "w1@host",
        "delivery_info": {"exchange": "", "routing_key": "celery", "priority": 0, "redelivered": False},
        "reply_to": "reply",
        "correlation_id": task_id,
        "root_id": task_id,
        "retries": retries,
        "is_eager": False,
    }
    return build_tracer(task.name, task, app=app, hostname="w1@host")(task_id, [], {}, message)


def _writes(task: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, StoreResult]]:
    """The ``(state, outcome)`` of each write ``task``'s backend sends to Redis from now on."""
    store = task.backend.lease_store
    writes: list[tuple[str, StoreResult]] = []
    store_once = store.store

    def store_and_note(task_id: str, token: int | None, meta: Any, **options: Any) -> StoreResult:
        outcome: StoreResult = store_once(task_id, token, meta, **options)
        writes.append((options["state"], outcome))
        return outcome

    monkeypatch.setattr(store, "store", store_and_note)
    return writes


def _ms_until_due(app: Celery, task_id: str) -> int:
    store = app.backend.lease_store
    seconds, micros = app.backend.client.time()
    due = app.backend.client.hget(store.keys.lease(task_id), "leaseExpireAt")
    return int(due) - (int(seconds) * 1000 + int(micros) // 1000)


def test_the_retry_write_keeps_the_lease_waiting_for_the_retrys_countdown(
    traced: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    @traced.task(bind=True, base=ProgressLeasedTask, shared=False)
    def later(self: Any) -> None:
        raise self.retry(countdown=100)

    traced.finalize()
    task = traced.tasks[later.name]
    writes = _writes(task, monkeypatch)
    task_id = str(uuid.uuid4())
    _run(traced, task, task_id)
    # retry() moved the lease to RETRYING; the RETRY write after it, with the token, sets its
    # due time again: from the countdown its fence carries, plus fenced_requeue_timeout (60 s).
    assert [(state, outcome.code, outcome.detail) for state, outcome in writes] == [("RETRY", "stored", "RETRYING")]
    assert traced.backend.lease_store.read(task_id).status == "RETRYING"  # type: ignore[union-attr]
    assert 155_000 < _ms_until_due(traced, task_id) <= 160_000


def test_a_lost_owners_late_result_is_stored_once(traced: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    @traced.task(bind=True, base=ProgressLeasedTask, shared=False)
    def late(self: Any) -> str:
        lease = current_lease()
        assert lease is not None
        lease.mark_lost("expired: no renewal within the lease ttl")  # locally: nobody took over
        return "late"

    traced.finalize()
    task = traced.tasks[late.name]
    writes = _writes(task, monkeypatch)
    task_id = str(uuid.uuid4())
    outcome = _run(traced, task, task_id)
    assert outcome.retval == "late"
    # Stored through the fence by the attempt itself; the tracer's own write of it is skipped.
    assert [(state, outcome.code) for state, outcome in writes] == [("SUCCESS", "stored")]
    assert traced.backend.get_task_meta(task_id)["result"] == "late"


def test_a_duplicate_delivery_runs_nothing_and_writes_nothing(traced: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    @traced.task(bind=True, base=ProgressLeasedTask, shared=False, track_started=True)
    def once(self: Any) -> None:
        ran.append(self.request.id)

    traced.finalize()
    task = traced.tasks[once.name]
    task_id = str(uuid.uuid4())
    task.push_request(id=task_id, hostname="w0@host", delivery_info={"is_eager": False})
    try:
        hooks.on_task_prerun(task, task_id, task.request)  # another delivery owns the task
        owner = traced.backend.lease_store.read(task_id)
        assert owner is not None
        writes = _writes(task, monkeypatch)
        _run(traced, task, task_id)
    finally:
        task.pop_request()
    assert not ran
    assert writes == []  # its STARTED included
    still = traced.backend.lease_store.read(task_id)
    assert still is not None and (still.status, still.owner_token) == ("RUNNING", owner.owner_token)


def test_a_retry_is_called_a_retry_and_a_takeover_a_takeover_when_the_lease_is_acquired(
    traced: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    @traced.task(bind=True, base=ProgressLeasedTask, shared=False)
    def retried_once(self: Any) -> None:
        if not self.request.retries:
            raise self.retry(countdown=100)

    traced.finalize()
    task = traced.tasks[retried_once.name]
    task_id = str(uuid.uuid4())
    _run(traced, task, task_id)  # stores RETRY: the lease waits RETRYING
    with caplog.at_level(logging.INFO, logger="celery_fenced.worker.lifecycle"):
        _run(traced, task, task_id, retries=1)  # the retry's delivery
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lease acquired")]
    assert line.endswith("attempt=2 (retry 1 of the task, not a takeover)"), line
    store = traced.backend.lease_store
    owner = store.acquire("taken", "w1@host/1/a", ttl_ms=60_000, task_name=task.name, max_takeovers=3)
    store.lapse("taken", "w1@host/1/a", owner.token, mode="release")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="celery_fenced.worker.lifecycle"):
        _run(traced, task, "taken", retries=1)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("lease acquired")]
    assert line.endswith("attempt=2 (takeover of a LAPSED lease)"), line


def test_a_retried_runs_acquire_tells_flower_it_is_a_retry(traced: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(events, "send_about", lambda app, kind, lease, **fields: sent.append((kind, fields)))

    @traced.task(bind=True, base=ProgressLeasedTask, shared=False)
    def retried_twice(self: Any) -> None:
        if self.request.retries < 2:
            raise self.retry(countdown=100)

    traced.finalize()
    task = traced.tasks[retried_twice.name]
    task_id = str(uuid.uuid4())
    for retries in range(3):
        _run(traced, task, task_id, retries=retries)
    acquired = [fields for kind, fields in sent if kind == "task-progress" and fields.get("version") == 0]
    assert [(f["cause"], f["retries"], f["reason"]) for f in acquired] == [
        ("retry", 1, "retry 1 of the task, not a takeover"),
        ("retry", 2, "retry 2 of the task, not a takeover"),
    ]
    assert all(f["takeovers"] == 0 for f in acquired)
