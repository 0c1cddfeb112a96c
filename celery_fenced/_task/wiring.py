"""Connect an app's fenced tasks to Celery's worker, without loading the worker side.

:func:`connect_worker_hooks` runs when a ``ProgressLeasedTask`` is bound to an app, in every
process that defines fenced tasks, a web process that only sends them included. It connects
Celery signal receivers that hand over to :mod:`celery_fenced._worker.hooks` only for a
fenced task running in a worker, names the worker's bootsteps and the task's request class
for Celery to load when a worker starts, and registers ``celery_fenced.reap``. So a process
that never runs a worker never imports the worker side, and never registers its fork handler.

This module is the task side's one door to the worker side: the task class reaches
:mod:`~celery_fenced._worker.lifecycle` and :mod:`~celery_fenced._worker.interrupt` through
:func:`worker_lifecycle` and :func:`worker_interrupt`, only from inside an attempt (which
exists only in a worker), as Celery loads the bootsteps by name.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from celery import Celery, signals

from .._celery.apps import first_time
from .._reaper.reaper import register_reaper_task
from ..conf import add_defaults
from .calls import tag_publish
from .running import began

__all__ = ["WORKER_HOOKS", "WORKER_REQUEST", "connect_worker_hooks", "worker_interrupt", "worker_lifecycle"]

#: The module that does the worker's side of each signal.
WORKER_HOOKS = "celery_fenced._worker.hooks"

#: The request class of a fenced task, which Celery loads by name in a worker.
WORKER_REQUEST = "celery_fenced._worker.request:FencedRequest"

# Global: the worker side, loaded at a worker's first fenced task (a process that only sends
# tasks never loads it), then read by the receivers of every task without an import.
_hooks: ModuleType | None = None
_lifecycle: ModuleType | None = None


def _worker_hooks() -> ModuleType:
    """:mod:`celery_fenced._worker.hooks`, imported at the first fenced task a worker runs."""
    global _hooks
    if _hooks is None:
        from .._worker import hooks

        _hooks = hooks
    return _hooks


def worker_lifecycle() -> ModuleType:
    """:mod:`celery_fenced._worker.lifecycle`, imported at the first attempt (an attempt exists
    only in a worker)."""
    global _lifecycle
    if _lifecycle is None:
        from .._worker import lifecycle

        _lifecycle = lifecycle
    return _lifecycle


def worker_interrupt() -> ModuleType:
    """:mod:`celery_fenced._worker.interrupt`, for an attempt's ``shield()`` (in a worker only)."""
    from .._worker import interrupt

    return interrupt


def connect_worker_hooks(app: Celery) -> None:
    """Connect the receivers and the bootsteps for ``app`` (idempotent)."""
    add_defaults(app)  # app.conf.fenced_* read as documented, defaults included
    if not first_time(app, "worker hooks"):
        return
    signals.before_task_publish.connect(tag_publish, weak=False, dispatch_uid="celery_fenced.publish")
    signals.task_received.connect(_on_task_received, weak=False, dispatch_uid="celery_fenced.received")
    signals.task_prerun.connect(_on_task_prerun, weak=False, dispatch_uid="celery_fenced.prerun")
    signals.task_postrun.connect(_on_task_postrun, weak=False, dispatch_uid="celery_fenced.postrun")
    signals.worker_process_init.connect(_on_worker_process_init, weak=False, dispatch_uid="celery_fenced.process_init")
    signals.worker_process_shutdown.connect(
        _on_process_shutdown, weak=False, dispatch_uid="celery_fenced.process_shutdown"
    )
    signals.worker_shutdown.connect(_on_worker_shutdown, weak=False, dispatch_uid="celery_fenced.worker_shutdown")
    signals.worker_shutting_down.connect(
        _on_worker_shutting_down, weak=False, dispatch_uid="celery_fenced.worker_shutting_down"
    )
    # Loaded by name when a worker starts (Celery's blueprints accept "module:Class").
    app.steps["worker"].add(f"{WORKER_HOOKS}:FencedWorkerStep")
    app.steps["consumer"].add(f"{WORKER_HOOKS}:ChildExitWatch")
    app.steps["consumer"].add(f"{WORKER_HOOKS}:ReconnectWatch")
    app.steps["consumer"].add(f"{WORKER_HOOKS}:HoldBackBehindStalledOwners")
    register_reaper_task(app)


# The receivers below run for every task of the process: the fenced check is inline, and the
# worker side is reached through the module global once it is loaded.


def _on_task_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    task = getattr(request, "task", None)
    if task is not None and getattr(task, "fenced_task", False):
        (_hooks or _worker_hooks()).on_task_received(request)


def _on_task_prerun(sender: Any = None, task_id: Any = None, task: Any = None, **_: Any) -> None:
    if task is None or not getattr(task, "fenced_task", False):
        return
    request = task.request
    if request.is_eager or request.called_directly:  # no lease outside a worker
        return
    (_hooks or _worker_hooks()).on_task_prerun(task, task_id, request)


def _on_task_postrun(sender: Any = None, task: Any = None, state: Any = None, **_: Any) -> None:
    if task is None or not getattr(task, "fenced_task", False):
        return
    request = task.request
    if began(request):  # not for an eager call: no lease to end
        (_hooks or _worker_hooks()).on_task_postrun(task, state, request)


def _on_worker_process_init(**_: Any) -> None:
    _worker_hooks().on_worker_process_init()


def _on_process_shutdown(**_: Any) -> None:
    _worker_hooks().on_process_shutdown()


def _on_worker_shutdown(**_: Any) -> None:
    _worker_hooks().on_worker_shutdown()


def _on_worker_shutting_down(**_: Any) -> None:
    _worker_hooks().on_worker_shutting_down()
