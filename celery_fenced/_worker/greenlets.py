"""The gevent pool: every fenced task of the process runs in a greenlet of one hub.

Where the heartbeat runs. gevent's monkey patching (which ``celery worker -P gevent`` applies
before it imports anything else) makes the package's threads, the heartbeat, the reaper and
the reservation writer, greenlets of the same hub as the tasks. That is the choice, for two
reasons:

* a greenlet stuck in a wait (a socket read with no timeout, a lock, a sleep) is parked in
  the hub: the heartbeat still runs, sees no progress within the stage's deadline, stops
  renewing that one lease and throws the interrupt into that one greenlet (:func:`throw_later`);
* a greenlet stuck in code that never yields blocks the hub, and with it everything the process
  would do: its heartbeat cannot run, so *every* lease the process holds expires within its TTL
  and each task is taken over elsewhere. A heartbeat on a real OS thread would keep those
  leases alive while no task of the process can move, and its Redis connections would not
  belong to the hub that patched their sockets.

The interrupt is thrown from the hub (``loop.run_callback``), which runs only while the task's
greenlet is parked: it lands at the greenlet's wait. The callback asks the lease first
(:meth:`~celery_fenced._task.interrupter.Interrupter.landing`): an interrupt withdrawn because the body
ended or entered a shield meanwhile is not thrown, so it never lands in Celery's code after
the body. Only this module imports gevent, and only on the gevent pool.
"""

from __future__ import annotations

import logging
from typing import Any

from .._task.owner import OwnedLease
from .._task.running import thread_state
from ..exceptions import ConfigurationError

__all__ = ["PATCHED_MODULES", "check_patched", "current", "throw_later"]

logger = logging.getLogger("celery_fenced.worker.greenlets")

#: What the worker needs gevent to have patched: the waits a task can block in, and threads.
PATCHED_MODULES = ("socket", "select", "threading", "time")


def check_patched() -> None:
    """Refuse a gevent worker whose standard library gevent has not patched, in one message."""
    from gevent import local, monkey

    missing = [name for name in PATCHED_MODULES if not monkey.is_module_patched(name)]
    if missing:
        raise ConfigurationError(
            f"the gevent pool needs gevent's monkey patching, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not patched: start "
            "the worker with the celery command (`celery -A proj worker -P gevent`), which patches first, "
            "or call gevent.monkey.patch_all() before anything imports Celery"
        )
    if not isinstance(thread_state, local.local):
        raise ConfigurationError(
            "celery_fenced was imported before gevent patched threading, so its per-task state would be "
            "shared by every greenlet: call gevent.monkey.patch_all() before anything imports celery_fenced"
        )


def current() -> Any:
    """The greenlet running the caller."""
    from gevent import getcurrent

    return getcurrent()


def throw_later(lease: OwnedLease, runner: Any, exc: BaseException) -> bool:
    """Have the hub throw ``exc`` into ``runner`` at its wait; True: it is sent, not landed.

    Called under the interrupter's lock (so the hub runs the callback after it is released).
    """
    if runner.dead:
        logger.warning("task %s[%s]: its greenlet is gone, nothing to interrupt", lease.task_name, lease.task_id)
        return False
    _schedule(lease, runner, exc)
    return True


def _land(lease: OwnedLease, runner: Any, exc: BaseException) -> None:
    """In the hub: the task's greenlet is parked, so the exception is raised at its wait."""
    if runner.dead:
        return
    due = lease.interrupter.landing()
    if due is None:  # a parked greenlet holds the interrupter's lock: the next turn of the loop
        _schedule(lease, runner, exc)
        return
    if not due:
        return
    try:
        runner.throw(exc)
    except BaseException:  # the hub must go on whatever the greenlet did with it
        logger.exception("throwing the interrupt into a greenlet failed")


def _schedule(lease: OwnedLease, runner: Any, exc: BaseException) -> None:
    from gevent import get_hub

    get_hub().loop.run_callback(_land, lease, runner, exc)
