"""The worker side of Celery's signals and bootsteps: acquire before the body, release after
it, check the worker at start (:mod:`~celery_fenced._worker.checks`), run its main-process
threads, stop them at shutdown.

:func:`celery_fenced._task.wiring.connect_worker_hooks` connects these when a ``ProgressLeasedTask``
is bound to an app; its receivers load this module only when a fenced task runs in a worker,
and Celery loads the bootsteps by name when a worker starts. The bootstep refuses what cannot
work (the eventlet pool, gevent without its monkey patching, another result backend, bad
settings).

* ``task_prerun`` takes the lease, before Celery's STARTED write, so that write already
  carries the token. A duplicate or finished delivery is marked to be skipped.
* ``task_postrun`` ends a lease that no result write ended (ignored results, ``Ignore``,
  ``Reject``, retries with ignored results).
* One heartbeat thread per process serves every lease of that process; it starts lazily
  at the first lease, so it exists in prefork children, in the threads pool and in solo (on
  gevent, a greenlet of the tasks' hub).
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

from celery import bootsteps

from .._celery.compat import hold_back_consumer, maintain_pool, pool_processes
from .._celery.startup import exit_in_one_line
from .._lease.gateway import denied_redis_commands
from .._lease.liveness_store import worker_id_of
from .._lease.store import is_fenced
from .._reaper.reaper import REAP_COMMAND, REAP_TASK_NAME
from .._telemetry import events
from ..exceptions import ConfigurationError, LeaseUnavailableError
from .attempt import begin, skip
from .checks import (
    check_redis_commands,
    check_worker,
    lease_redis_reachable,
    pool_kind_of,
    warn_if_redis_can_evict,
)
from .interrupt import install_interrupt_handler, set_pool_kind
from .lifecycle import SEND_AGAIN_LIMIT, acquire, release, times_sent_again
from .process import WORKER_PROCESS
from .runtime import reservation_writer_of, runtime_of, stop_runtimes

__all__ = [
    "CHILD_WATCH_INTERVAL",
    "ChildExitWatch",
    "FencedWorkerStep",
    "HoldBackBehindStalledOwners",
    "ReconnectWatch",
    "on_process_shutdown",
    "on_task_postrun",
    "on_task_prerun",
    "on_task_received",
    "on_worker_process_init",
    "on_worker_shutdown",
    "on_worker_shutting_down",
    "quiet_reaper_runs",
    "register_reap_command",
]

logger = logging.getLogger("celery_fenced.worker.hooks")


class FencedWorkerStep(bootsteps.StartStopStep):
    """Checks the worker at start, runs its reaper thread, stops its threads at shutdown.

    Celery orders a step that requires none as it may (the order changes from one start to
    the next): this one may stop before the pool, which then still runs bodies, in this
    process on threads, gevent and solo, until they end in a warm shutdown. Their heartbeat
    stops only once the worker has stopped (:func:`on_worker_shutdown`), or with the process.
    """

    label = "celery-fenced"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        with exit_in_one_line():  # one line naming what is wrong, not a traceback ending in it
            check_worker(parent.app, parent.pool_cls)
            check_redis_commands(parent.app)
        # Set before the pool forks, so prefork children inherit them: the events' settings, and
        # this start's id (its liveness record's), under which a child files its hand-offs.
        events.configure(enabled=bool(getattr(parent, "task_events", False)), hostname=parent.hostname)
        WORKER_PROCESS.worker_id = worker_id_of(parent.hostname, os.getpid(), secrets.token_hex(4))
        WORKER_PROCESS.stopping.clear()  # this start's: shared with the children it forks
        quiet_reaper_runs()
        register_reap_command()

    def start(self, parent: Any) -> None:
        set_pool_kind(pool_kind_of(parent.pool_cls))
        app = parent.app
        if not is_fenced(app):
            return
        if lease_redis_reachable(app):
            warn_if_redis_can_evict(app)
        runtime = runtime_of(app)
        assert runtime is not None
        runtime.start_main_process_threads(
            parent.hostname, hub=getattr(parent, "hub", None), worker_id=WORKER_PROCESS.worker_id
        )

    def stop(self, parent: Any) -> None:
        stop_runtimes(heartbeat=False)

    def terminate(self, parent: Any) -> None:
        """Celery's terminate (a cold shutdown, ``WorkerTerminate``) calls this, not
        :meth:`stop`: the same threads stop."""
        self.stop(parent)


def register_reap_command() -> None:
    """Register the ``celery_fenced.reap`` control command: it wakes the worker's reaper thread.

    A heartbeat that gives a stalled lease up asks for a reap at once; a control message
    reaches the worker's main process through Celery's pidbox (a broadcast), whatever the
    user's ``task_routes`` and queues, and never waits in a task queue.
    """
    from celery.worker.control import control_command

    control_command(name=REAP_COMMAND, visible=False)(_reap_now)


def _reap_now(state: Any, **_: Any) -> dict[str, str]:
    """``celery_fenced.reap`` (control): wake this worker's reaper thread."""
    runtime = runtime_of(state.consumer.app, create=False)
    if runtime is None or runtime.reaper is None:
        return {"error": "no reaper thread in this worker"}
    runtime.reaper.wake()
    return {"ok": "reaping"}


class _QuietReaperRuns(logging.Filter):
    """Drops the worker's "received" and "succeeded" lines of ``celery_fenced.reap`` runs.

    The reaper runs every few seconds on every worker: its own runs would fill the log. What
    it did (claims, re-sends, abandons) is logged by the reaper itself.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if record.levelno > logging.INFO or not isinstance(args, dict):
            return True
        return args.get("name") != REAP_TASK_NAME


_QUIET = _QuietReaperRuns()


def quiet_reaper_runs() -> None:
    """Attach the filter to the loggers of Celery's "received" and "succeeded" lines (idempotent)."""
    for name in ("celery.worker.strategy", "celery.app.trace"):
        target = logging.getLogger(name)
        if _QUIET not in target.filters:
            target.addFilter(_QUIET)


class ReconnectWatch(bootsteps.StartStopStep):
    """Consumer: after a lost broker connection, the unstarted requests Celery dropped are sent again.

    Celery's consumer restarts its steps when it reconnects, and drops the requests it held
    in its prefetch buffer and eta timer (``Consumer.on_close``): their reservations are made
    due at once (see :meth:`~celery_fenced._worker.reservations.ReservationWriter.dropped`).
    """

    label = "celery-fenced reconnect watch"
    # Started once the connection step has connected (it retries until it can).
    requires = ("celery.worker.consumer.connection:Connection",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.connected_before = False

    def start(self, parent: Any) -> None:
        writer = reservation_writer_of(parent.app)
        if self.connected_before and writer is not None:
            writer.dropped()
        self.connected_before = True


class HoldBackBehindStalledOwners(bootsteps.StartStopStep):
    """Consumer, Redis broker: take no message while a re-send this worker passed on still has
    its old owner in a process here and every process is taken.

    Such a worker would only park the next message behind the stalled owner, as it parked the
    re-send (see :class:`~celery_fenced._worker.reservations.ReservationWriter`); the message is
    left to a worker that can start it.
    """

    label = "celery-fenced hold back"
    # Started after the task consumer (made again at each reconnect) exists.
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, parent: Any) -> None:
        writer = reservation_writer_of(parent.app)
        if writer is None:
            return

        def limit() -> int:
            return int(getattr(parent.controller, "max_concurrency", None) or parent.pool.num_processes)

        hold_back_consumer(parent, lambda: writer.holding_back(limit()))


class ChildExitWatch(bootsteps.StartStopStep):
    """Prefork master: notice a dead child within ``CHILD_WATCH_INTERVAL`` seconds.

    The pool learns of a child killed by a signal through its process sentinel, or else
    through a maintenance timer that runs every 5 seconds. Until it learns, Celery writes
    no ``WorkerLostError`` and the lease is only given up when its TTL runs out; this
    timer on the worker's event loop looks at the children more often and lets the pool
    clean up at once when one has exited.
    """

    label = "celery-fenced child watch"

    def start(self, parent: Any) -> None:
        hub = getattr(parent, "hub", None)
        pool = getattr(parent, "pool", None)
        if hub is None or pool is None or pool_processes(pool) is None:
            return
        hub.call_repeatedly(CHILD_WATCH_INTERVAL, _maintain_if_a_child_exited, pool)


#: How often the prefork master looks for children that died.
CHILD_WATCH_INTERVAL = 0.25


def _maintain_if_a_child_exited(pool: Any) -> None:
    try:
        if any(proc.exitcode is not None for proc in pool_processes(pool) or ()):
            maintain_pool(pool)
    except Exception:
        logger.debug("child watch failed", exc_info=True)


# -- signal receivers ---------------------------------------------------------------------------


def on_task_received(request: Any) -> None:
    """A fenced task's message arrived: the reservation writer reserves it."""
    task = request.task
    writer = reservation_writer_of(task.app)
    if writer is not None:
        writer.received(request)


def on_task_prerun(task: Any, task_id: Any, request: Any) -> None:
    """A fenced task's body is about to run in a worker (``request`` is its): take its lease."""
    install_interrupt_handler()
    attempt = begin(request)
    try:
        acquire(task, request, attempt)
    except ConfigurationError as exc:
        # Not a passing fault: sending it again would loop. The body raises it instead, so
        # the task ends as a FAILURE naming what is wrong.
        attempt.fail_with(exc)
    except Exception as exc:
        sent = times_sent_again(request)
        if sent < SEND_AGAIN_LIMIT:
            skip(request, attempt, "unavailable")  # the body sends it again (send_again)
            logger.exception("could not acquire the lease of task %s[%s]", task.name, task_id)
            return
        # An error that outlasts every re-send (a Redis that refuses a command): the task
        # ends as a FAILURE naming it, rather than being sent again without end.
        denied = denied_redis_commands(task.backend.client)
        missing = f"; the lease Redis user may not run {', '.join(c for c, _ in denied)}" if denied else ""
        error = LeaseUnavailableError(
            f"the lease of task {task_id} could not be acquired on {sent + 1} deliveries in a row "
            f"(sent again {sent} times); the last error: {type(exc).__name__}: {exc}{missing}"
        )
        attempt.fail_with(error)
        logger.error("could not acquire the lease of task %s[%s] again: %s", task.name, task_id, error)


def on_task_postrun(task: Any, state: Any, request: Any) -> None:
    """A fenced attempt's body and result writes are done: end a lease no write ended."""
    release(task, request, state)


def on_worker_process_init() -> None:
    """A pool process starts: prefork children (and the solo pool, whose bootstep then says "solo")."""
    set_pool_kind("prefork", only_if_unset=True)


def on_process_shutdown() -> None:
    """A pool process stops: stop its heartbeat."""
    stop_runtimes()


def on_worker_shutting_down() -> None:
    """The worker's shutdown began (``worker_shutting_down``, in its main process, from its
    signal handler): tell every heartbeat of the worker, prefork children's included, to
    publish new details at once (:meth:`~celery_fenced._worker.heartbeat.Heartbeat.publish_details`).

    It only sets a shared byte: a signal handler may have interrupted any code, so it takes
    no lock and wakes no thread (each heartbeat looks at the flag within
    :data:`~celery_fenced._worker.heartbeat.STOPPING_POLL`).
    """
    WORKER_PROCESS.stopping.set()


def on_worker_shutdown() -> None:
    """The worker stopped, its pool included (``worker_shutdown``): stop the heartbeat."""
    stop_runtimes()
