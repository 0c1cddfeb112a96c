"""The worker's reaper thread: a pass on a real Redis and broker."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.signals import before_task_publish

from celery_fenced._worker.fork_guard import FORK_GUARD
from celery_fenced._worker.reaper_thread import ReaperThread
from tests.unit.conftest import queued

CALL = {"task": "proj.report", "args": [7], "kwargs": {}, "options": {"queue": "reports"}}


def test_a_pass_publishes_its_re_sends_without_holding_the_fork_guard(fenced_app: Celery) -> None:
    store = fenced_app.backend.lease_store
    state = store.acquire("t1", "host/1/a", ttl_ms=60_000, task_name="proj.report", max_takeovers=3, call=CALL).state
    assert store.lapse("t1", "host/1/a", state.owner_token, mode="release") == "ok"
    guard_held_at_publish: list[bool] = []

    def at_publish(**_: Any) -> None:
        guard_held_at_publish.append(FORK_GUARD.locked())

    before_task_publish.connect(at_publish, weak=False)
    try:
        ReaperThread(fenced_app).run_once()
    finally:
        before_task_publish.disconnect(at_publish)
    assert [m["headers"]["id"] for m in queued(fenced_app, "reports")] == ["t1"]
    # A fork waiting for the guard would wait for the broker's round trip (and for good
    # while the broker is unreachable): the pass publishes outside it.
    assert guard_held_at_publish == [False]
    assert not FORK_GUARD.locked()
