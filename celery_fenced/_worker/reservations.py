"""Reserve on receipt: the lease begins when the worker's main process receives the message.

A message a worker received waits in its prefetch buffer or eta timer before a process
starts it. Celery drops those requests when the broker connection is lost, a killed worker
takes them with it, and kombu's Redis transport then holds the messages for an hour. So the
main process records a reservation for each fenced task it receives (``RESERVED``, the
message's call, this worker, an expiry of eta + ``fenced_start_timeout``), and the reaper
sends again any whose task did not start in time (cause ``unstarted``).

* :meth:`ReservationWriter.received` runs on the consumer's event loop: it only notes the
  request. A timer of that loop (or, for a worker without one, a timer thread) looks, every
  :data:`GATHER` seconds while requests arrive, for those no process started within
  :data:`GATHER` seconds, and hands them to a thread of the main process, which writes them
  with one script call (:meth:`~celery_fenced._lease.store.LeaseStore.reserve_many`). Most tasks,
  where a process is free, start first: they cost neither a round trip nor a wake-up of that
  thread, and no task process waits on the write.
* Every way a received request ends on this worker takes its entry out of the worker's
  reservations (``fenced:reserved:<worker id>``), so the set holds only what the worker still
  holds: a process accepting it (:meth:`ReservationWriter.started`: a prefetched, eta or
  rate-limited request alike, once it reaches the pool), a revoke or an expiry before it started,
  a reject (:meth:`ReservationWriter.ended`). Only a request whose reservation was written
  costs a round trip, made by the writing thread, one per batch (``unreserve.lua``); a lost
  connection's dropped requests leave with :meth:`ReservationWriter.dropped`, and the worker's
  shutdown removes the whole set (``worker_left.lua``).
* A re-sent message received while the task's old owner still holds a process of this worker
  (a stalled owner whose body did not return) is not kept waiting behind it: if no process
  started it within :data:`GATHER` seconds, the writing thread sends it on (once per worker,
  :data:`PASSED_ON_HEADER`), and on a Redis broker the worker takes no message while such an
  owner holds a process and every process is taken (:meth:`ReservationWriter.holding_back`), so
  a worker that can start it gets it. The copy left here is a duplicate when it starts.
* :meth:`ReservationWriter.dropped`, at a reconnect, makes the reservations of the requests
  Celery dropped due now, and wakes the reaper: their re-send waits for neither the start
  timeout nor beat.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any

from celery import Celery
from celery.worker import state as worker_state

from .._celery.compat import UTC, request_context
from .._celery.headers import HANDED_OFF_BY_HEADER, PASSED_ON_HEADER, PUBLISH_ID_HEADER
from .._lease.state import Reservation, ReserveOutcome
from .._lease.store import LeaseStore, lease_store_of
from .._reaper.reaper import send_call
from .._task.calls import recorded_call
from ..conf import ensure_conf
from .fork_guard import FORK_GUARD

__all__ = ["GATHER", "LOOK_OVERDUE", "MAX_BATCH", "MAX_HELD", "PASS_ON_MARGIN", "ReservationWriter"]

logger = logging.getLogger("celery_fenced.worker.reservations")

#: The most reservations written by one script call.
MAX_BATCH = 500

#: How long a received message may wait for a process before its reservation is written, seconds.
GATHER = 0.02

#: A scheduled look this many seconds overdue is taken as lost (a timer entry cancelled at a
#: reconnect): the next received message schedules another.
LOOK_OVERDUE = 1.0

#: The most unstarted reservations a worker remembers for a reconnect (the oldest go first).
MAX_HELD = 100_000

#: What wakes the writing thread for the requests that ended (:meth:`ReservationWriter.ended`).
_UNRESERVE = "unreserve"

#: Seconds a worker waits, held back, before it passes a message on: its last fetch (a Redis
#: BRPOP waits up to the transport's ``brpop_timeout``, 1 s by default) is over by then.
PASS_ON_MARGIN = 0.25


class ReservationWriter:
    """Writes the reservations of the fenced tasks this worker receives, in batches.

    Args:
        app: the worker's app (its result backend is the fenced one).
        hostname: the worker's node name, recorded as ``reservedBy``.
        worker_id: this start of the worker (:func:`~celery_fenced._lease.liveness_store.worker_id_of`), whose
            liveness record answers for its reservations (the hostname when not given).
        on_dropped: called after dropped reservations were made due (to wake the reaper).
        hub: the worker's event loop (kombu's ``Hub``), whose timer looks for the requests
            that did not start in time; without one, a timer thread does.
    """

    def __init__(
        self,
        app: Celery,
        hostname: str,
        on_dropped: Callable[[], None] | None = None,
        hub: Any = None,
        worker_id: str | None = None,
    ) -> None:
        self.app = app
        self.hostname = hostname
        self.worker_id = worker_id or hostname
        self.on_dropped = on_dropped
        self.start_timeout = ensure_conf(app).start_timeout
        self.written = 0  # reservations written
        self.handed = 0  # batches handed to the writing thread (each wakes it once)
        self.looks = 0  # looks the timer ran
        self._hub = hub
        # Batches to write, and copies to pass on (request, reservation, the workers that did).
        self._queue: queue.SimpleQueue[list[Any] | tuple[Any, Reservation, list[str]] | str | None] = (
            queue.SimpleQueue()
        )
        self._held: dict[str, Any] = {}  # reserved here and not started, each request: insertion order
        self._written: dict[str, None] = {}  # of those, the ones in this worker's reserved set
        self._ended: list[str] = []  # ended here: their entries are to leave the set
        self._arrived: deque[tuple[float, Any]] = deque()  # (received at, request), oldest first
        self._look_at: float | None = None  # when the scheduled look at them is due (monotonic)
        self._held_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failing: str | None = None
        self._unreserve_failing: str | None = None
        self._written_through: LeaseStore | None = None  # the writing thread's store, once used
        self._takeovers: dict[str, int] = {}
        self._behind: set[str] = set()  # unstarted copies of tasks whose old owner runs here
        self._passed_on: dict[str, None] = {}  # tasks passed on while their old owner runs here
        self.passed_on = 0  # messages passed on
        transport_options = app.conf.broker_transport_options or {}
        self._pass_on_after = float(transport_options.get("brpop_timeout", 1)) + PASS_ON_MARGIN

    # -- the event loop's side: never waits ---------------------------------------------------

    def received(self, request: Any) -> None:
        """A fenced task's message arrived (``task_received``): reserve it unless it starts soon."""
        now = time.monotonic()
        with self._held_lock:
            self._held[request.id] = request
            if len(self._held) > MAX_HELD:
                del self._held[next(iter(self._held))]
            self._arrived.append((now, request))
            if self._look_at is not None and now < self._look_at + LOOK_OVERDUE:
                return
            self._look_at = now + GATHER
        self._look_after(GATHER)

    def started(self, task_id: str) -> None:
        """A process accepted the task: its reservation is no longer this worker's to drop,
        and leaves the worker's reservations."""
        self._end(task_id)

    def ended(self, task_id: str) -> None:
        """The request ended before a process started it (revoked, expired, rejected): its
        reservation leaves the worker's reservations."""
        self._end(task_id)

    def _end(self, task_id: str) -> None:
        with self._held_lock:
            self._held.pop(task_id, None)
            self._behind.discard(task_id)
            if task_id not in self._written:
                return  # never written (most tasks start at once): nothing to take out
            del self._written[task_id]
            self._ended.append(task_id)
            if len(self._ended) > 1:
                return  # the writing thread was woken for the first, and takes them all
        self._queue.put(_UNRESERVE)

    def look(self) -> None:
        """Hand the requests that waited :data:`GATHER` seconds unstarted to the writing thread.

        Runs on the timer; while requests are still to be looked at, it schedules itself again,
        :data:`GATHER` seconds later: one look serves every request that arrived meanwhile (a
        look per request cost the event loop more than the rest of the receipt), and a request
        waits between one and two windows before it is handed on.
        """
        now = time.monotonic()
        due = []
        with self._held_lock:
            self.looks += 1
            arrived = self._arrived
            while arrived and now - arrived[0][0] >= GATHER:
                request = arrived.popleft()[1]
                if request.id in self._held:
                    due.append(request)
                    if request.eta is None and _older_copy_runs_here(request):
                        # Held back from now on (Redis): no fetch of this worker's will take
                        # the copy it is about to pass on.
                        self._behind.add(request.id)
                        self._passed_on[request.id] = None
            again = bool(arrived)
            self._look_at = now + GATHER if again else None
        self._hand(due)
        if again:
            self._look_after(GATHER)

    def _hand(self, requests: list[Any]) -> None:
        """Give the writing thread one batch (each batch wakes it once)."""
        if requests:
            self.handed += 1
            self._queue.put(requests)

    @property
    def looking(self) -> bool:
        """A look at received requests is scheduled (some may still start in time)."""
        return self._look_at is not None

    def _look_after(self, seconds: float) -> None:
        if self._hub is not None:
            self._hub.call_later(seconds, self.look)
        else:
            timer = threading.Timer(seconds, self.look)
            timer.daemon = True
            timer.start()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._run, name="celery-fenced-reservations", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is held and not started yet, then stop the thread and join it."""
        with self._held_lock:
            unstarted = [request for _, request in self._arrived if request.id in self._held]
            self._arrived.clear()
        self._hand(unstarted)
        self._queue.put(None)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def dropped(self) -> int:
        """Celery dropped this worker's unstarted requests (a lost connection): make their
        reservations due now, so the reaper sends them again at once. Returns how many."""
        with self._held_lock:
            held, self._held = self._held, {}
            # Received just before the connection went, and not yet written (still in their
            # window, or with the writing thread): written now, due at once, or nothing would
            # send them again before the broker's visibility timeout.
            unwritten = [request for task_id, request in held.items() if task_id not in self._written]
            self._written.clear()  # the script takes them out of the worker's reservations
        task_ids = list(held)
        if not task_ids:
            return 0
        with FORK_GUARD:
            reservations = [self._reservation(request) for request in unwritten]
        try:
            store = self._store()
            due_now = [replace(r, expires_in_ms=0) for r in reservations if r is not None]
            written = store.reserve_many(due_now, self.hostname, self.worker_id) if due_now else []
            count = store.lapse_reserved(task_ids, self.hostname, self.worker_id)
            count = max(count, written.count(ReserveOutcome.RESERVED))
        except Exception as exc:
            logger.warning(
                "could not make %d dropped reservations due (%r): they are sent again after fenced_start_timeout",
                len(task_ids),
                exc,
            )
            return 0
        if count:
            logger.warning("%d received tasks were dropped with the broker connection: they are sent again", count)
            if self.on_dropped is not None:
                self.on_dropped()
        return count

    def lost(self, request: Any) -> bool:
        """The process running ``request`` was lost, perhaps before it took the lease: make the
        task's reservation due now (written if it was not), so the reaper sends it again at once.

        A process accepting a task ends this worker's hold on it (:meth:`started`), and most
        tasks are never reserved at all: one lost between its acceptance and its lease left no
        record, and Celery's ``WorkerLostError`` would have been its only result. A lease its
        owner took is left alone (``reserve.lua``): the store lapses it. Runs in the main
        process, before Celery writes the failure; returns whether a reservation was made due.
        """
        with self._held_lock:
            self._held.pop(request.id, None)
            self._written.pop(request.id, None)  # made due below: the script takes it out
        with FORK_GUARD:
            reservation = self._reservation(request)
        if reservation is None:
            return False
        try:
            store = self._store()
            outcomes = store.reserve_many([replace(reservation, expires_in_ms=0)], self.hostname, self.worker_id)
        except Exception as exc:
            logger.warning(
                "task %s[%s]: its process was lost and its reservation could not be made due (%r); "
                "a process lost before it took the lease leaves the task to Celery's WorkerLostError",
                request.name,
                request.id,
                exc,
            )
            return False
        if ReserveOutcome.RESERVED not in outcomes:
            return False  # an owner took the lease, or the task finished
        logger.warning(
            "task %s[%s]: its process was lost before it took the lease: it is sent again", request.name, request.id
        )
        if self.on_dropped is not None:
            self.on_dropped()
        return True

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            items = [self._queue.get()]
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = any(item is None for item in items)
            with self._held_lock:  # a process may have started some meanwhile
                waiting = [r for item in items if isinstance(item, list) for r in item if r.id in self._held]
                passing = [item for item in items if isinstance(item, tuple) and item[0].id in self._held]
            for start in range(0, len(waiting), MAX_BATCH):
                self._write(waiting[start : start + MAX_BATCH])
            for request, reservation, passed_by in passing:
                self._pass_on(request, reservation, passed_by)
            self._unreserve()
        if self._written_through is not None:
            # The backend of this thread (Celery keeps one per thread) is not used again.
            with contextlib.suppress(Exception):
                self._written_through.client.connection_pool.disconnect()

    def _write(self, requests: list[Any]) -> None:
        # Built under the guard: a request's context is a cached_property, whose class-wide
        # lock a fork must not copy while it is held. The round trips are made outside it, so
        # a Redis or broker outage does not hold up the pool's forks.
        with self._held_lock:
            behind = {request.id for request in requests if request.id in self._behind}
            self._behind -= behind
        with FORK_GUARD:
            reservations = [r for r in (self._reservation(request) for request in requests) if r is not None]
            passed = {
                request.id: _passed_on_by(request_context(request)) for request in requests if request.id in behind
            }
        outcomes = self._reserve(reservations) if reservations else []
        with self._held_lock:
            for reservation, outcome in zip(reservations, outcomes, strict=False):
                if outcome != ReserveOutcome.RESERVED:
                    continue
                if reservation.task_id in self._held:
                    self._written[reservation.task_id] = None
                    if len(self._written) > MAX_HELD:
                        del self._written[next(iter(self._written))]
                else:  # started, revoked or rejected while it was written: out again
                    self._ended.append(reservation.task_id)
        if not outcomes:  # not written: whether it is a re-send is unknown, and it stays here
            with self._held_lock:
                for task_id in passed:
                    self._passed_on.pop(task_id, None)
            return
        # Only a re-sent task (its lease was claimed: now reserved here) is passed on, once by
        # each worker; a copy of a task whose owner still holds the lease is a duplicate.
        for reservation, outcome in zip(reservations, outcomes, strict=False):
            passed_by = passed.get(reservation.task_id)
            if passed_by is None:
                continue
            if outcome != ReserveOutcome.RESERVED or reservation.call is None or self.hostname in passed_by:
                with self._held_lock:
                    self._passed_on.pop(reservation.task_id, None)
                continue
            # Sent once this worker's last fetch is over (kombu's Redis transport waits up to
            # brpop_timeout for a message, and keeps one it got while held back): else it
            # would fetch the copy itself.
            timer = threading.Timer(
                self._pass_on_after, self._queue.put, [(_request_of(requests, reservation), reservation, passed_by)]
            )
            timer.daemon = True
            timer.start()

    def _unreserve(self) -> None:
        """Take the entries of the requests that ended here out of the worker's reservations."""
        with self._held_lock:
            ended, self._ended = self._ended, []
        for start in range(0, len(ended), MAX_BATCH):
            batch = ended[start : start + MAX_BATCH]
            try:
                store = self._written_through = self._store()
                store.unreserve(batch, self.worker_id)
            except Exception as exc:
                text = f"{type(exc).__name__}: {exc}"
                if text != self._unreserve_failing:  # an outage is said once
                    logger.warning(
                        "could not take %d ended requests out of this worker's reservations (%s): they "
                        "stay listed there until they are due, or the worker stops",
                        len(batch),
                        text,
                    )
                    self._unreserve_failing = text
            else:
                self._unreserve_failing = None

    def _pass_on(self, request: Any, reservation: Reservation, passed_by: list[str]) -> None:
        """Send a copy of a re-sent message this worker cannot start (its old owner holds a
        process here), for a worker that can; the copy held here is a duplicate when it starts."""
        assert reservation.call is not None
        try:
            send_call(
                self.app,
                reservation.task_id,
                reservation.call,
                task_name=reservation.task_name,
                publish_id=reservation.publish_id,
                headers={PASSED_ON_HEADER: ",".join([*passed_by, self.hostname])},
            )
        except Exception as exc:
            logger.warning(
                "task %s[%s] waits behind its stalled owner here, and could not be passed on (%r): it is "
                "sent again after fenced_start_timeout",
                reservation.task_name,
                reservation.task_id,
                exc,
            )
            return
        self.passed_on += 1
        logger.warning(
            "task %s[%s]: its stalled owner still holds a process of this worker: the re-sent message is "
            "passed on, for a worker that can start it",
            reservation.task_name,
            reservation.task_id,
        )

    def holding_back(self, limit: int) -> bool:
        """True while this worker should take no message: a task it passed on still has its old
        owner in a process here, and every process (``limit``) is taken or spoken for."""
        if not self._passed_on:
            return False
        running = {request.id for request in tuple(worker_state.active_requests)}
        with self._held_lock:
            for task_id in [task_id for task_id in self._passed_on if task_id not in running]:
                del self._passed_on[task_id]
            held = bool(self._passed_on)
        return held and len(worker_state.reserved_requests) >= limit

    def _reserve(self, reservations: list[Reservation]) -> list[Any]:
        """Write ``reservations``; their outcomes, in order (none when the write failed)."""
        try:
            store = self._written_through = self._store()
            outcomes: list[Any] = store.reserve_many(reservations, self.hostname, self.worker_id)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if text != self._failing:
                logger.warning(
                    "could not reserve %d received tasks (%s): a message dropped before it starts waits "
                    "for the broker's redelivery",
                    len(reservations),
                    text,
                )
                self._failing = text
            return []
        self._failing = None
        self.written += len(reservations)
        return outcomes

    def _store(self) -> LeaseStore:
        with FORK_GUARD:  # the backend and its store are cached_properties, built on first use
            return lease_store_of(self.app, "reserve on receipt")

    def _max_takeovers(self, task: Any) -> int:
        value = self._takeovers.get(task.name)
        if value is None:
            value = self._takeovers[task.name] = ensure_conf(self.app).policy_for(task).max_takeovers
        return value

    def _reservation(self, request: Any) -> Reservation | None:
        try:
            task = request.task
            context = request_context(request)
            call = recorded_call(task, context)
            delay = 0.0
            eta = request.eta
            if eta is not None:
                delay = max(0.0, (eta - datetime.now(UTC)).total_seconds())
                if call is not None:
                    call["options"]["eta"] = eta  # a re-sent copy keeps its countdown
            return Reservation(
                task_id=request.id,
                expires_in_ms=int((delay + self.start_timeout) * 1000),
                task_name=task.name,
                call=call,
                max_takeovers=self._max_takeovers(task),
                publish_id=str(getattr(context, PUBLISH_ID_HEADER, None) or ""),
                handed_off_by=str(getattr(context, HANDED_OFF_BY_HEADER, None) or ""),
            )
        except Exception:
            logger.exception("could not reserve task %s", getattr(request, "id", None))
            return None


def _older_copy_runs_here(request: Any) -> bool:
    """An earlier delivery of ``request``'s task runs in a process of this worker: its old
    owner, whose lease was taken from it, since this copy was sent again."""
    try:
        return any(other.id == request.id and other is not request for other in tuple(worker_state.active_requests))
    except RuntimeError:  # the set changed while it was read: look again at the next message
        return False


def _passed_on_by(context: Any) -> list[str]:
    """The workers that passed this message on (its :data:`PASSED_ON_HEADER`)."""
    value = getattr(context, PASSED_ON_HEADER, None)
    return [name for name in str(value).split(",") if name] if value else []


def _request_of(requests: list[Any], reservation: Reservation) -> Any:
    """The request ``reservation`` was made for."""
    return next(request for request in requests if request.id == reservation.task_id)
