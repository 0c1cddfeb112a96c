"""The worker's checks at its start: what cannot work is refused in one line before "ready".

:class:`~celery_fenced._worker.hooks.FencedWorkerStep` runs them when a worker starts. The
pool must be one fenced tasks work on (not eventlet; gevent only with its monkey patching,
and on Celery 5.6 not with ``worker_disable_prefetch``), the app's result backend the fenced
one, every fenced task's options valid, and the lease Redis user allowed the commands the
scripts run. What may
change while the worker runs is only said: a lease Redis that cannot be reached yet, one
that may evict keys.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from redis.exceptions import RedisError, ResponseError

from .._celery.apps import first_time
from .._celery.compat import GEVENT_POOL_CANNOT_DISABLE_PREFETCH, active_apps, registered_tasks
from .._lease.gateway import denied_commands_text, denied_redis_commands
from .._lease.store import is_fenced, lease_store_of
from ..conf import ensure_conf
from ..exceptions import ConfigurationError
from . import greenlets

__all__ = [
    "UNSUPPORTED_POOLS",
    "check_redis_commands",
    "check_worker",
    "lease_redis_reachable",
    "pool_kind_of",
    "warn_if_redis_can_evict",
]

logger = logging.getLogger("celery_fenced.worker.checks")

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


def check_redis_commands(app: Celery) -> None:
    """Refuse to start, naming the commands, when the lease Redis user may not run one that
    fenced tasks need (``docs/guarantees.rst``, "A restricted Redis").

    A Redis that cannot be reached is not checked here (the start says so, and it may come back).

    Raises:
        ConfigurationError: the user may not run a needed command.
    """
    if not is_fenced(app):
        return
    denied = denied_redis_commands(app.backend.client)
    if denied:
        raise ConfigurationError(denied_commands_text(denied))


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


def warn_if_redis_can_evict(app: Celery) -> None:
    """Warn once per app if the lease Redis may evict keys: an evicted lease is a false takeover."""
    if not first_time(app, "eviction check"):
        return
    try:
        policy = app.backend.client.config_get("maxmemory-policy").get("maxmemory-policy")
    except ResponseError as exc:
        # A restricted user (no CONFIG, as managed services have it): say what is unchecked.
        logger.warning(
            "celery-fenced: could not read the lease Redis's maxmemory-policy (%s): make sure it is "
            "noeviction, or leases may be evicted (an evicted lease is a false takeover)",
            exc,
        )
        return
    except (RedisError, AttributeError):
        return
    if policy and policy != "noeviction":
        logger.warning(
            "the lease Redis has maxmemory-policy=%s: it may evict leases, and an evicted lease is "
            "a false takeover. Use maxmemory-policy=noeviction for the result/lease database.",
            policy,
        )
