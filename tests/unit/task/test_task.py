"""ProgressLeasedTask (task.py) outside a worker, and its body's endings under a lease."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore

from celery_fenced import ProgressLeasedTask
from celery_fenced._worker.hooks import on_task_postrun, on_task_prerun
from celery_fenced._worker.runtime import runtime_of
from celery_fenced.exceptions import LeaseInterrupted, LeaseLostError


@pytest.fixture
def app(fenced_app: Celery) -> Iterator[Celery]:
    yield fenced_app
    runtime = runtime_of(fenced_app, create=False)
    if runtime is not None:
        runtime.stop()


def test_an_eager_call_runs_without_a_lease_and_still_checks_its_progress(app: Celery) -> None:
    seen: dict[str, Any] = {}

    @app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def report(self: Any, rows: int) -> int:
        self.progress("LOAD_DATA", rows=rows)
        with self.shield():
            seen.update(token=self.fencing_token, checkpoint=self.checkpoint, key=self.idempotency_key("upload"))
        with self.stream("call-ai", first_token_timeout=5, idle_timeout=5) as stream:
            for _ in stream.wrap("abc"):
                pass
        seen["chunks"] = stream.chunks
        return rows

    result = report.apply(args=(3,), task_id="e1")
    assert result.get() == 3
    assert seen == {"token": 0, "checkpoint": None, "key": "e1:upload", "chunks": 3}
    with pytest.raises(TypeError, match="rows"):
        report.apply(args=(object(),), throw=True)


def test_the_lease_api_outside_a_running_task_says_so(app: Celery) -> None:
    @app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def report(self: Any) -> None: ...

    with pytest.raises(RuntimeError, match="only while the task runs"):
        report.progress("LOAD_DATA")
    with pytest.raises(ValueError, match="step"):
        report.idempotency_key("")


def run_in_worker(task: Any, task_id: str, *args: Any) -> Any:
    """Run ``task`` as the worker's tracer does: prerun (the lease), the body, postrun."""
    task.push_request(id=task_id, hostname="w1@host", delivery_info={"is_eager": False}, args=args, kwargs={})
    try:
        on_task_prerun(task, task_id, task.request)
        try:
            return task(*args)
        finally:
            on_task_postrun(task, "SUCCESS", task.request)
    finally:
        task.pop_request()


def test_a_body_under_a_lease_sees_its_token_and_progresses(app: Celery) -> None:
    @app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def report(self: Any) -> int:
        self.progress("LOAD_DATA", rows=1)
        assert self.lease is not None and self.lease.status == "RUNNING"
        with self.shield():
            self.progress("PERSIST")
        return int(self.fencing_token)

    token = run_in_worker(report, "w1")
    state = app.backend.lease_store.read("w1")
    assert token > 0 and state.owner_token == token and state.status == "DONE"  # type: ignore[union-attr]


def test_an_eager_call_of_itself_inside_a_leased_body_runs_without_the_body_s_lease(app: Celery) -> None:
    seen: list[tuple[int, bool]] = []

    @app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def report(self: Any, inner: bool) -> int:
        if not inner:
            self.apply(args=(True,), task_id="inner")  # an eager call of the same task, another id
        seen.append((int(self.fencing_token), self.checkpoint is None))
        return int(self.fencing_token)

    token = run_in_worker(report, "w2", False)
    assert token > 0
    assert seen == [(0, True), (token, True)]  # the eager call holds no lease; the body its own


def test_an_interrupted_body_ends_as_ignore_and_stores_nothing(app: Celery) -> None:
    @app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def report(self: Any) -> None:
        raise LeaseInterrupted(self.request.id, self.fencing_token, "taken over")  # as the interrupt lands

    with pytest.raises(Ignore):
        run_in_worker(report, "w2")
    assert app.backend.get_task_meta("w2")["status"] == "PENDING"


def test_a_lost_lease_turns_the_bodys_error_into_ignore(app: Celery) -> None:
    @app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def report(self: Any) -> None:
        app.backend.lease_store.client.delete(app.backend.keyspace.lease(self.request.id))
        raise LeaseLostError(self.request.id, self.fencing_token, "gone")

    with pytest.raises(Ignore):
        run_in_worker(report, "w3")


def test_a_body_error_of_an_owner_is_its_own(app: Celery) -> None:
    @app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def report(self: Any) -> None:
        raise KeyError("row 7")

    with pytest.raises(KeyError):
        run_in_worker(report, "w4")
