"""Reserve on receipt, in the worker's main process: only what no process started in time is written.

A real app with the fenced backend on a real Redis, Celery's own worker requests, and the
two timers the writer runs on: the worker's event loop (kombu's ``Hub``) and, for a worker
without one, a timer thread.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.worker.request import Request
from kombu import Message
from kombu.asynchronous import Hub
from kombu.utils.json import dumps

from celery_fenced import ProgressLeasedTask
from celery_fenced._worker.reservations import GATHER, LOOK_OVERDUE, ReservationWriter
from tests.support.processes import wait_until
from tests.support.redis_server import RedisServer


@pytest.fixture
def app(redis_server: RedisServer) -> Iterator[Celery]:
    redis_server.client(12).flushdb()
    app = Celery("reserving", set_as_current=False)
    app.conf.update(broker_url="memory://", result_backend="fenced+" + redis_server.url(12))

    @app.task(bind=True, base=ProgressLeasedTask, name="reserving.report", shared=False)
    def report(self: Any, report_id: int) -> None:
        """The task received."""

    yield app
    app.backend.client.connection_pool.disconnect()
    app.close()


def received(app: Celery) -> Request:
    """A worker request for a new message of the fenced task, as the consumer builds it."""
    task = app.tasks["reserving.report"]
    sent = app.amqp.as_task_v2(str(uuid.uuid4()), task.name, args=(7,), kwargs={})
    message = Message(
        body=dumps(sent.body),
        content_type="application/json",
        content_encoding="utf-8",
        headers=sent.headers,
        properties=sent.properties,
        delivery_info={"exchange": "", "routing_key": "celery"},
    )
    return Request(message, app=app, task=task)


def status(app: Celery, task_id: str) -> str | None:
    state = app.backend.lease_store.read(task_id)
    return state.status if state is not None else None


@pytest.fixture(params=["event loop", "timer thread"])
def writer(request: pytest.FixtureRequest, app: Celery) -> Iterator[tuple[ReservationWriter, Callable[[], None]]]:
    """The writer, and what runs its timer: the hub's own ``fire_timers`` or nothing (a thread)."""
    hub = Hub() if request.param == "event loop" else None
    writer = ReservationWriter(app, "w1@host", hub=hub)
    writer.start()
    yield writer, (hub.fire_timers if hub is not None else lambda: None)
    writer.stop()


def test_a_task_a_process_starts_in_time_is_never_written(
    app: Celery, writer: tuple[ReservationWriter, Callable[[], None]]
) -> None:
    reservations, run_timers = writer
    started, waiting = received(app), received(app)
    reservations.received(started)
    reservations.received(waiting)
    reservations.started(started.id)

    def written() -> bool:
        run_timers()
        return status(app, waiting.id) == "RESERVED"

    wait_until(written, 10, "the unstarted task's reservation")
    assert reservations.written == 1
    assert status(app, started.id) is None  # no lease at all: it cost no round trip
    assert reservations.handed == 1  # the writing thread was woken once, for the unstarted task


def test_tasks_that_all_start_in_time_never_wake_the_writing_thread(
    app: Celery, writer: tuple[ReservationWriter, Callable[[], None]]
) -> None:
    reservations, run_timers = writer
    requests = [received(app) for _ in range(20)]
    late = 0
    for request in requests:
        late += received_then_started(reservations, request)
    deadline = time.monotonic() + 3 * GATHER
    while time.monotonic() < deadline:  # the timer's looks, for three windows
        run_timers()
    wait_until(lambda: not reservations.looking, 5, "the timer to stop looking")
    assert reservations.handed <= late and reservations.written <= late, late
    assert sum(status(app, r.id) is not None for r in requests) <= late


def received_then_started(reservations: ReservationWriter, request: Request) -> bool:
    """Receive ``request`` and start it at once; True when this thread took a whole window
    (:data:`GATHER`) between the two (a busy machine), so the timer may rightly have handed it
    on: only such a request may be handed or written."""
    before = time.monotonic()
    reservations.received(request)
    reservations.started(request.id)
    return time.monotonic() - before >= GATHER


def test_requests_arriving_steadily_share_looks(
    app: Celery, writer: tuple[ReservationWriter, Callable[[], None]]
) -> None:
    """A look per request would cost the event loop more than the rest of the receipt."""
    reservations, run_timers = writer
    count, spacing = 60, GATHER / 10
    started = time.monotonic()
    late = 0
    for number in range(count):
        late += received_then_started(reservations, received(app))
        while time.monotonic() < started + (number + 1) * spacing:  # the next arrival
            run_timers()
    elapsed = time.monotonic() - started
    deadline = time.monotonic() + 3 * GATHER
    while reservations.looking and time.monotonic() < deadline:
        run_timers()
    wait_until(lambda: not reservations.looking, 5, "the timer to stop looking")
    assert reservations.looks <= elapsed / GATHER + 3  # one per window, not one per request
    if elapsed < count * GATHER / 4:  # the arrivals kept their pace: several a window
        assert reservations.looks < count / 2
    assert reservations.handed <= late and reservations.written <= late, late


def test_what_is_held_unstarted_is_written_when_the_worker_stops(app: Celery) -> None:
    reservations = ReservationWriter(app, "w1@host", hub=Hub())  # its timer never runs here
    reservations.start()
    request = received(app)
    reservations.received(request)
    reservations.stop()
    assert status(app, request.id) == "RESERVED"


def test_a_request_received_just_before_the_connection_went_is_sent_again_at_the_reconnect(app: Celery) -> None:
    """Received, not yet written (still in its window), and dropped by Celery with the broker
    connection: written at the reconnect, due at once, so the reaper sends it again instead of
    the broker after its visibility timeout (seen once as a task that never finished)."""
    reservations = ReservationWriter(app, "w1@host", hub=Hub())  # its timer never runs here
    reservations.start()
    try:
        request = received(app)
        reservations.received(request)
        assert status(app, request.id) is None  # not written yet
        assert reservations.dropped() == 1
        state = app.backend.lease_store.read(request.id)
        assert state is not None and state.status == "RESERVED"
        seconds, micros = app.backend.client.time()
        assert int(state.lease_expire_at) <= int(seconds) * 1000 + int(micros) // 1000  # due now
    finally:
        reservations.stop()


def test_a_look_cancelled_with_the_loops_timer_is_scheduled_again_by_the_next_message(app: Celery) -> None:
    """Celery cancels timer entries at a reconnect: a look that never comes must not leave the
    writer waiting for it."""
    hub = Hub()
    reservations = ReservationWriter(app, "w1@host", hub=hub)
    reservations.start()
    try:
        first = received(app)
        reservations.received(first)
        hub.timer.clear()  # the fault: the scheduled look is cancelled
        time.sleep(LOOK_OVERDUE + 0.05)  # and stays missing until it is overdue
        later = received(app)
        reservations.received(later)

        def written() -> bool:
            hub.fire_timers()
            return status(app, later.id) == "RESERVED"

        wait_until(written, 10, "the reservation after the cancelled look")
        assert status(app, first.id) == "RESERVED"  # the first one too: it was still unstarted
    finally:
        reservations.stop()


def reserved_set(app: Celery, worker_id: str = "w1@host") -> set[str]:
    """The task ids in the worker's reserved set (``fenced:reserved:<worker id>``)."""
    store = app.backend.lease_store
    return {store.keys.task_id_of(key) for key in store.client.zrange(store.keys.reserved_by(worker_id), 0, -1)}


def test_a_written_reservation_leaves_the_workers_set_however_its_request_ends(
    app: Celery, writer: tuple[ReservationWriter, Callable[[], None]]
) -> None:
    """Started (prefetched, eta or rate-limited alike), or ended unstarted (revoked, expired,
    rejected): the set holds only what the worker still holds."""
    reservations, run_timers = writer
    started, revoked, waiting = received(app), received(app), received(app)
    for request in (started, revoked, waiting):
        reservations.received(request)

    def written() -> bool:
        run_timers()
        return reserved_set(app) == {started.id, revoked.id, waiting.id}

    wait_until(written, 10, "the three reservations")
    reservations.started(started.id)
    reservations.ended(revoked.id)
    wait_until(lambda: reserved_set(app) == {waiting.id}, 10, "the ended requests to leave the set")
    assert status(app, revoked.id) == "RESERVED"  # the lease is its result write's to change


def test_a_request_that_ends_while_its_reservation_is_written_still_leaves_the_set(app: Celery) -> None:
    """The writing thread picked the request while it was held; it started before the write
    returned: its entry is taken out again, in the same pass."""
    reservations = ReservationWriter(app, "w1@host", hub=Hub())  # its timer never runs here
    request = received(app)
    reservations.received(request)
    reservations.started(request.id)  # between the thread's pick and its write
    reservations._write([request])
    assert reserved_set(app) == {request.id}
    reservations._unreserve()  # what the thread does next
    assert reserved_set(app) == set()
