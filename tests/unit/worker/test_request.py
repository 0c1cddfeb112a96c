"""The worker's request class for fenced tasks (_worker/request.py), as Celery's worker drives it:
the context of a main-process write names the process that ran the task and says whether Celery
cancelled it or puts its message back, and a lost process gives up the lease it held.

Celery's own worker requests over a real message of a fenced task, on a real Redis; the pool's
side (accepting, cancelling, time limits, a lost process) is Celery's request API called as its
pool calls it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from time import monotonic

import pytest
from billiard.einfo import ExceptionInfo
from celery import Celery
from celery.exceptions import WorkerLostError
from celery.worker import state as worker_state
from kombu import Message
from kombu.utils.json import dumps

from celery_fenced import ProgressLeasedTask
from celery_fenced._backend.backend import CANCELLED, PUT_BACK
from celery_fenced._celery.compat import UTC, request_context
from celery_fenced._worker.process import WORKER_PROCESS
from celery_fenced._worker.request import FencedRequest, cancelled_here
from celery_fenced._worker.reservations import ReservationWriter
from celery_fenced._worker.runtime import runtime_of
from celery_fenced.conf import ensure_conf
from tests.support.processes import wait_until
from tests.unit.lease.helpers import server_ms

HOSTNAME = "w1@host"


@pytest.fixture
def app(fenced_app: Celery) -> Iterator[Celery]:
    """The fenced app with its tasks: acknowledged on receipt or late, and, after a hard time
    limit or a lost process, put back to the queue, acknowledged, or sent again as a retry."""

    @fenced_app.task(base=ProgressLeasedTask, name="proj.report", shared=False)
    def report() -> None: ...

    @fenced_app.task(base=ProgressLeasedTask, name="proj.late", shared=False, acks_late=True)
    def late() -> None: ...

    @fenced_app.task(
        base=ProgressLeasedTask,
        name="proj.late_and_sent_again",
        shared=False,
        acks_late=True,
        acks_on_failure_or_timeout=False,
        reject_on_worker_lost=True,
    )
    def late_and_sent_again() -> None: ...

    @fenced_app.task(  # options that take effect with acks_late only
        base=ProgressLeasedTask,
        name="proj.early",
        shared=False,
        acks_on_failure_or_timeout=False,
        reject_on_worker_lost=True,
    )
    def early() -> None: ...

    @fenced_app.task(base=ProgressLeasedTask, name="proj.retried_when_lost", shared=False, retry_on_worker_lost=True)
    def retried_when_lost() -> None: ...

    yield fenced_app
    runtime = runtime_of(fenced_app, create=False)
    if runtime is not None:
        runtime.stop()


@pytest.fixture(autouse=True)
def worker_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as a prefork child's (its state restored after the test); the requests it
    accepted, forgotten."""
    monkeypatch.setattr(WORKER_PROCESS, "pool_kind", "prefork")
    monkeypatch.setattr(WORKER_PROCESS, "cancelled_here", set())
    before = set(worker_state.active_requests)
    yield
    for request in set(worker_state.active_requests) - before:
        worker_state.task_ready(request)


def received(
    app: Celery, task_name: str = "proj.report", expires: datetime | None = None, retries: int = 0
) -> FencedRequest:
    """The worker request for a new message of ``task_name``, as the consumer builds it."""
    task = app.tasks[task_name]
    sent = app.amqp.as_task_v2(str(uuid.uuid4()), task.name, args=(), kwargs={}, expires=expires, retries=retries)
    message = Message(
        body=dumps(sent.body),
        content_type="application/json",
        content_encoding="utf-8",
        headers=sent.headers,
        properties=sent.properties,
        delivery_info={"exchange": "", "routing_key": "celery"},
    )
    return FencedRequest(message, app=app, task=task, hostname=HOSTNAME)


def lost_process() -> ExceptionInfo:
    """What Celery's pool hands ``on_failure`` when the process running the task died."""
    try:
        raise WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 0.")
    except WorkerLostError:
        return ExceptionInfo()


def test_a_fenced_task_runs_with_this_request_class(app: Celery) -> None:
    assert app.tasks["proj.report"].Request == "celery_fenced._worker.request:FencedRequest"


def test_the_context_of_a_main_process_write_names_the_process_that_ran_the_task(app: Celery) -> None:
    request = received(app)
    assert request_context(request).worker_pid is None  # no process has it yet
    request.on_accepted(4321, monotonic())
    assert request_context(request).worker_pid == 4321


def test_on_the_gevent_pool_the_context_names_the_workers_own_process(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(WORKER_PROCESS, "pool_kind", "gevent")
    request = received(app)
    request.on_accepted(140_230_117_520_576, monotonic())  # Celery's gevent pool: the greenlet's id
    assert request_context(request).worker_pid == os.getpid()


@pytest.mark.parametrize(("pool", "told_to_the_body"), [("solo", True), ("threads", False), ("prefork", False)])
def test_a_cancelled_request_says_so_in_its_context(
    app: Celery, monkeypatch: pytest.MonkeyPatch, pool: str, told_to_the_body: bool
) -> None:
    monkeypatch.setattr(WORKER_PROCESS, "pool_kind", pool)
    request, other = received(app), received(app)
    assert not getattr(request_context(request), CANCELLED, False)
    request.cancel(None)  # a cold shutdown, before any pool process took it
    assert getattr(request_context(request), CANCELLED, False) is True
    assert not getattr(request_context(other), CANCELLED, False)
    assert cancelled_here(request.id) is told_to_the_body  # only solo runs the body in the cancelling thread
    assert not cancelled_here(other.id)


@pytest.mark.parametrize(
    ("task_name", "soft", "put_back"),
    [
        ("proj.late_and_sent_again", False, True),  # acks_late, not acked on a timeout: Celery puts it back
        ("proj.late_and_sent_again", True, False),  # a soft limit ends nothing
        ("proj.late", False, False),  # acked on a timeout: it does not run again
        ("proj.report", False, False),  # acked on receipt
        ("proj.early", False, False),  # acked on receipt all the same
    ],
)
def test_a_hard_time_limit_whose_message_celery_puts_back_says_so(
    app: Celery, task_name: str, soft: bool, put_back: bool
) -> None:
    request = received(app, task_name)
    request.on_accepted(4321, monotonic())
    request.on_timeout(soft, 5.0)
    assert bool(getattr(request_context(request), PUT_BACK, False)) is put_back


@pytest.mark.parametrize(
    ("task_name", "retries", "owner_pid", "outcome"),
    [
        ("proj.late_and_sent_again", 0, 4321, "lapsed"),  # task_reject_on_worker_lost: the message is put back
        ("proj.retried_when_lost", 0, 4321, "retrying"),  # Celery 5.7's retry_on_worker_lost: a retry is sent
        ("proj.retried_when_lost", 3, 4321, "lapsed"),  # past max_retries: Celery writes the WorkerLostError
        ("proj.late", 0, 4321, None),  # not sent again: Celery's WorkerLostError write gives it up
        ("proj.early", 0, 4321, None),  # acked on receipt: not sent again either
        ("proj.late_and_sent_again", 0, 4322, None),  # another process's lease: kept
        ("proj.retried_when_lost", 0, 4322, None),  # the same
    ],
)
def test_a_lost_process_whose_message_is_sent_again_gives_up_the_lease_it_held(
    app: Celery, task_name: str, retries: int, owner_pid: int, outcome: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    store = app.backend.lease_store
    lost = received(app, task_name, retries=retries)
    lost.on_accepted(4321, monotonic())
    owner = f"{HOSTNAME}/{owner_pid}/a1"  # the lost process, or another process of the same worker
    assert store.acquire(lost.id, owner, ttl_ms=60_000, task_name=lost.name, max_takeovers=3).outcome.runs
    with caplog.at_level("WARNING", logger="celery_fenced.worker.request"):
        lost.on_failure(lost_process())
    after = store.read(lost.id)
    assert after is not None
    said = [r.getMessage() for r in caplog.records if r.name == "celery_fenced.worker.request"]
    # What is sent again takes the task over at once, not after the TTL: the request gives the
    # lease up before Celery sends it. Celery's retry finds it waiting for that retry: a lease
    # given up would be due at once, and the reaper would send the original call first.
    given_up = f"task {task_name}[{lost.id}]: its process was lost: lease given up for a takeover"
    kept = f"task {task_name}[{lost.id}]: its process was lost: lease kept for Celery's retry"
    assert said == {"lapsed": [given_up], "retrying": [kept], None: []}[outcome]
    if outcome == "lapsed" or (outcome is None and owner_pid == 4321):
        assert after.status == "LAPSED" and after.raw["lapseReason"] == "worker-lost"
    elif outcome == "retrying":
        retry_delay, requeue_timeout = app.tasks[task_name].default_retry_delay, ensure_conf(app).requeue_timeout
        assert after.lease_expire_at is not None
        due_in = after.lease_expire_at - server_ms(store.client)
        assert after.status == "RETRYING"
        assert (retry_delay + requeue_timeout) * 1000 - 5_000 < due_in <= (retry_delay + requeue_timeout) * 1000
        assert store.due_task_ids(10) == []
    else:
        assert after.status == "RUNNING"


def test_a_process_accepting_the_task_ends_the_workers_hold_on_its_reservation(app: Celery) -> None:
    runtime = runtime_of(app)
    assert runtime is not None
    runtime.reservations = writer = ReservationWriter(app, HOSTNAME)
    started, waiting = received(app), received(app)
    writer.start()
    try:
        writer.received(started)
        writer.received(waiting)
        started.on_accepted(4321, monotonic())
    finally:
        writer.stop()  # a warm shutdown: what is held and not started is written
    assert app.backend.lease_store.read(started.id) is None
    assert app.backend.lease_store.read(waiting.id) is not None


@pytest.mark.parametrize("end", ["revoked", "expired", "rejected"])
def test_a_request_that_ends_unstarted_leaves_the_workers_reservations(app: Celery, end: str) -> None:
    """Revoked or expired when Celery looks before the pool, or rejected: no process ever
    accepts it, and its entry still leaves the worker's reserved set."""
    runtime = runtime_of(app)
    assert runtime is not None
    runtime.reservations = writer = ReservationWriter(app, HOSTNAME)
    expires = datetime.now(UTC) + timedelta(seconds=1) if end == "expired" else None
    request, other = received(app, expires=expires), received(app)
    store = app.backend.lease_store
    held = store.keys.reserved_by(HOSTNAME)
    writer.start()
    try:
        writer.received(request)
        writer.received(other)
        wait_until(lambda: store.client.zcard(held) == 2, 10, "both reservations written")
        if end == "revoked":
            worker_state.revoked.add(request.id)
            assert request.revoked()
        elif end == "expired":
            wait_until(request.revoked, 5, "the request to expire")
        else:
            request.reject(requeue=False)
        assert not other.revoked()  # a request that goes on is still held
        wait_until(lambda: store.client.zcard(held) == 1, 10, "the ended request's entry to leave the set")
        assert store.client.zrange(held, 0, -1) == [store.keys.lease(other.id).encode()]
    finally:
        worker_state.revoked.discard(request.id)
        writer.stop()
