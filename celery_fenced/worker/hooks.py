"""The worker side of Celery's signals and bootsteps: acquire before the body, release after
it, check the worker at start, run its main-process threads, stop them at shutdown.

:func:`celery_fenced.wiring.connect_worker_hooks` connects these when a ``ProgressLeasedTask``
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
from typing import Any

from celery import Celery, bootsteps
from redis.exceptions import RedisError, ResponseError

from .. import events
from ..apps import first_time
from ..compat import GEVENT_POOL_CANNOT_DISABLE_PREFETCH, active_apps, maintain_pool, pool_processes, registered_tasks
from ..conf import ensure_conf, exit_in_one_line
from ..exceptions import ConfigurationError
from ..reaper import REAP_TASK_NAME
from ..store import is_fenced, lease_store_of
from . import greenlets
from .attempt import begin
from .interrupt import install_interrupt_handler, set_pool_kind
from .lifecycle import acquire, release
from .runtime import reservation_writer_of, runtime_of, stop_runtimes

__all__ = [
    "CHILD_WATCH_INTERVAL",
    "UNSUPPORTED_POOLS",
    "ChildExitWatch",
    "FencedWorkerStep",
    "ReconnectWatch",
    "check_worker",
    "lease_redis_reachable",
    "on_process_shutdown",
    "on_task_postrun",
    "on_task_prerun",
    "on_task_received",
    "on_worker_process_init",
    "pool_kind_of",
    "quiet_reaper_runs",
    "warn_if_redis_can_evict",
]

logger = logging.getLogger(__name__)

#: Pools refused at start, with why.
UNSUPPORTED_POOLS = {
    "eventlet": "eventlet is in maintenance mode upstream; use the gevent pool for many concurrent waits",
}


def _is_fenced(task: Any) -> bool:
    return bool(getattr(task, "fenced_task", False))


def _shared_from_fenced_apps(app: Celery, names: list[str]) -> set[str]:
    """Of ``names``, those that another app of this process, one with the fenced backend, has too.

    ``@app.task`` shares a task with every app of the process by default, so a module with a
    fenced app and a plain one gives the plain app copies of the fenced tasks: they are the
    fenced app's, and do not stop the plain app's worker.
    """
    shared: set[str] = set()
    for other in active_apps():
        if other is app:
            continue
        try:
            if not is_fenced(other):
                continue
            shared |= set(names) & set(other.tasks)
        except Exception:  # an app that cannot be finalized or configured here is not the owner
            logger.debug("could not look at app %r", other, exc_info=True)
    return shared


def pool_kind_of(pool_cls: Any) -> str:
    """A short name for a worker pool class: "prefork", "threads", "solo", "gevent", …"""
    module = getattr(pool_cls, "__module__", None) or str(pool_cls)
    name = module.rsplit(".", 1)[-1]
    return {"thread": "threads", "asynpool": "prefork"}.get(name, name)


def check_worker(app: Celery, pool_cls: Any) -> None:
    """Refuse, with one clear message, a worker on which fenced tasks cannot work."""
    kind = pool_kind_of(pool_cls)
    if kind in UNSUPPORTED_POOLS:
        raise ConfigurationError(f"celery-fenced does not support the {kind} pool: {UNSUPPORTED_POOLS[kind]}")
    if kind == "gevent":
        if GEVENT_POOL_CANNOT_DISABLE_PREFETCH and app.conf.worker_disable_prefetch:
            raise ConfigurationError(
                "worker_disable_prefetch on Celery 5.6's gevent pool takes no message at all (the pool "
                "reports its running greenlets as its size; Celery 5.7 fixed it): unset it for this "
                "worker (a gevent worker holds at most one message beyond its running tasks), or "
                "upgrade Celery"
            )
        greenlets.check_patched()
    if not is_fenced(app):
        fenced = sorted(name for name, task in registered_tasks(app).items() if _is_fenced(task))
        shared = _shared_from_fenced_apps(app, fenced)
        if set(fenced) - shared:
            lease_store_of(app, "ProgressLeasedTask")  # raises, naming the backend in use
        if shared:
            logger.warning(
                "fenced tasks %s are shared into app %r from an app with the fenced backend; this "
                "worker's backend is %s, so they fail here if they are sent to it",
                ", ".join(sorted(shared)),
                app.main,
                type(app.backend).__name__,
            )
        return
    conf = ensure_conf(app)
    for task in app.tasks.values():
        if _is_fenced(task):
            conf.policy_for(task)


class FencedWorkerStep(bootsteps.StartStopStep):
    """Checks the worker at start, runs its reaper thread, stops the heartbeat at shutdown."""

    label = "celery-fenced"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        with exit_in_one_line():  # one line naming what is wrong, not a traceback ending in it
            check_worker(parent.app, parent.pool_cls)
        # Set before the pool forks, so prefork children inherit both.
        events.configure(enabled=bool(getattr(parent, "task_events", False)), hostname=parent.hostname)
        quiet_reaper_runs()

    def start(self, parent: Any) -> None:
        set_pool_kind(pool_kind_of(parent.pool_cls))
        app = parent.app
        if not is_fenced(app):
            return
        if lease_redis_reachable(app):
            warn_if_redis_can_evict(app)
        runtime = runtime_of(app)
        assert runtime is not None
        runtime.start_main_process_threads(parent.hostname, hub=getattr(parent, "hub", None))

    def stop(self, parent: Any) -> None:
        stop_runtimes()


def lease_redis_reachable(app: Celery) -> bool:
    """Say so, in one line, when the lease Redis cannot be reached at the worker's start.

    The worker still starts (Redis may come back, and the heartbeat and the reaper retry),
    but its operator reads why fenced tasks cannot run before "ready".
    """
    backend = app.backend
    try:
        backend.client.ping()
    except Exception as exc:
        logger.error(
            "celery-fenced: the lease Redis %s cannot be reached (%s): fenced tasks cannot start until it can",
            backend.as_uri(),
            exc,
        )
        return False
    return True


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
    due at once (see :meth:`~celery_fenced.worker.reservations.ReservationWriter.dropped`).
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


def warn_if_redis_can_evict(app: Celery) -> None:
    """Warn once per app if the lease Redis may evict keys: an evicted lease is a false takeover."""
    if not first_time(app, "eviction check"):
        return
    try:
        policy = app.backend.client.config_get("maxmemory-policy").get("maxmemory-policy")
    except (RedisError, ResponseError, AttributeError):
        return
    if policy and policy != "noeviction":
        logger.warning(
            "the lease Redis has maxmemory-policy=%s: it may evict leases, and an evicted lease is "
            "a false takeover. Use maxmemory-policy=noeviction for the result/lease database.",
            policy,
        )


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
        attempt.error = exc
    except Exception:
        attempt.skip = "unavailable"
        logger.exception("could not acquire the lease of task %s[%s]", task.name, task_id)


def on_task_postrun(task: Any, state: Any, request: Any) -> None:
    """A fenced attempt's body and result writes are done: end a lease no write ended."""
    release(task, request, state)


def on_worker_process_init() -> None:
    """A pool process starts: prefork children (and the solo pool, whose bootstep then says "solo")."""
    set_pool_kind("prefork", only_if_unset=True)


def on_process_shutdown() -> None:
    """A pool process stops: stop its heartbeat."""
    stop_runtimes()
