"""Every private or version-specific name of Celery, kombu, redis-py and Python, in one place.

celery-fenced runs on Celery and kombu 5.5, 5.6 and 5.7, redis-py 5 to 8 and Python 3.10 to
3.13. What differs between them, and every private name of those libraries the package needs,
is reached through this module only (a unit test holds the rest of the package to that). Each
shim says which version needs it, so it can go when that version is no longer supported.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from datetime import timezone
from enum import Enum
from types import MethodType
from typing import Any

import celery
from celery import states
from celery.app.task import Context
from celery.backends.base import _is_request_ignore_result
from redis.connection import AbstractConnection

__all__ = [
    "CELERY_VERSION",
    "GEVENT_POOL_CANNOT_DISABLE_PREFETCH",
    "UTC",
    "StoreResultHook",
    "StrEnum",
    "WeakrefSlot",
    "acks_on_timeout",
    "active_apps",
    "call_errbacks",
    "fail_chain",
    "failure_expires",
    "get_actual_ignore_result",
    "hold_back_consumer",
    "is_connected",
    "is_process_lost",
    "is_request_ignore_result",
    "leave_result_subscriptions",
    "maintain_pool",
    "outside_any_task",
    "pool_processes",
    "registered_tasks",
    "request_context",
    "result_meta",
]


#: ``(major, minor)`` of the Celery this process runs.
CELERY_VERSION = tuple(int(part) for part in celery.__version__.split(".")[:2])


# -- Python -------------------------------------------------------------------------------------

# Python 3.10: no enum.StrEnum (3.11+). The stand-in formats and prints as its value, like 3.11's.
if sys.version_info >= (3, 11):
    from enum import StrEnum
else:

    class StrEnum(str, Enum):
        """An enum whose members are strings (``enum.StrEnum`` of Python 3.11+)."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, format_spec: str) -> str:
            return str(self.value).__format__(format_spec)


# Python 3.10: no datetime.UTC (3.11+); it is this same object.
UTC = timezone.utc


class WeakrefSlot:
    """A base giving a slotted dataclass a ``__weakref__`` slot.

    Python 3.10: ``dataclass(weakref_slot=True)`` is 3.11+; ``dataclass(slots=True)`` on a
    subclass of this does the same on every version.
    """

    __slots__ = ("__weakref__",)


# -- redis-py -----------------------------------------------------------------------------------


if hasattr(AbstractConnection, "is_connected"):

    def is_connected(connection: Any) -> bool:
        """Whether a redis-py connection holds an open socket."""
        return bool(connection.is_connected)

else:
    # redis-py 5 to 7: no Connection.is_connected (8.0+); the socket is the private _sock.
    def is_connected(connection: Any) -> bool:
        """Whether a redis-py connection holds an open socket."""
        return connection._sock is not None


# -- Celery: the app and the worker -------------------------------------------------------------


def active_apps() -> list[Any]:
    """The Celery apps of this process (Celery 5.5–5.7: ``celery._state``, private)."""
    from celery._state import _get_active_apps

    return list(_get_active_apps())


def registered_tasks(app: Any) -> dict[str, Any]:
    """``app``'s task registry without finalizing the app (``app.tasks`` would; private ``_tasks``)."""
    return dict(app._tasks)


@contextlib.contextmanager
def outside_any_task() -> Iterator[None]:
    """Send as if no task were running in this thread (Celery 5.5–5.7: the private task stack).

    Inside a task, ``send_task`` makes the running task the parent of what it sends and
    passes on its priority.
    """
    from celery._state import _task_stack

    local = _task_stack._local
    saved = getattr(local, "stack", None)
    local.stack = []
    try:
        yield
    finally:
        if saved is None:
            del local.stack
        else:
            local.stack = saved


def pool_processes(pool: Any) -> list[Any] | None:
    """The child processes of a prefork pool (its billiard pool's private ``_pool``); None
    for a pool that has none (threads, solo)."""
    inner = getattr(pool, "_pool", None)
    if inner is None or not hasattr(inner, "maintain_pool"):
        return None
    return list(inner._pool)


def maintain_pool(pool: Any) -> None:
    """Let a prefork pool replace its exited children now (billiard's ``maintain_pool``)."""
    pool._pool.maintain_pool()


def hold_back_consumer(consumer: Any, hold: Callable[[], bool]) -> bool:
    """Redis broker: the worker's task consumer takes no message while ``hold()`` is true.

    The way Celery 5.6's own ``worker_disable_prefetch`` does it: kombu's Redis transport asks
    its channel's ``QoS.can_consume()`` before it fetches. Other transports (RabbitMQ, whose
    prefetch the broker enforces) are left alone; returns whether the hold is in place.
    """
    task_consumer = getattr(consumer, "task_consumer", None)
    if task_consumer is None or consumer.connection.transport.driver_type != "redis":
        return False
    qos = task_consumer.channel.qos
    can_consume = qos.can_consume

    def can_consume_unless_held(self: Any) -> bool:
        return False if hold() else bool(can_consume())

    qos.can_consume = MethodType(can_consume_unless_held, qos)
    return True


def request_context(request: Any) -> Any:
    """The task context Celery builds from a worker request's message (``Request._context``)."""
    return request._context


def acks_on_timeout(task: Any) -> bool:
    """Whether a late-acked task's message is acknowledged when a time limit ends it (else
    Celery puts it back, to run again): Celery 5.7's ``acks_on_timeout``, which falls back to
    ``acks_on_failure_or_timeout`` (the only setting of 5.5 and 5.6)."""
    value = getattr(task, "acks_on_timeout", None)
    if value is None:
        value = getattr(task, "acks_on_failure_or_timeout", True)
    return bool(value)


def is_process_lost(request: Any, exc: BaseException) -> bool:
    """Whether ``exc``, given to a worker request's ``on_failure``, says the process running it
    was lost: Celery's rule (``Request.on_failure``) for a ``WorkerLostError``, and, since
    billiard 4.3 reports a child's exit itself (Celery 5.7), a ``SystemExit`` or
    ``KeyboardInterrupt`` that the request's own cancel or revoke did not cause (the private
    ``_already_cancelled`` and ``_already_revoked``, Celery 5.5-5.7)."""
    from billiard.einfo import ExceptionWithTraceback
    from celery.exceptions import WorkerLostError

    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    if isinstance(exc, WorkerLostError):
        return True
    stopped_by_request = request._already_cancelled or request._already_revoked
    return isinstance(exc, (SystemExit, KeyboardInterrupt)) and not stopped_by_request


def __getattr__(name: str) -> Any:
    # ContextHookRequest is made on first use: it subclasses the worker's Request, which a
    # process that only sends tasks has no reason to import.
    if name == "ContextHookRequest":
        return _context_hook_request()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _context_hook_request() -> type:
    from celery.worker.request import Request

    class ContextHookRequest(Request):
        """Celery's worker ``Request``, whose context (the request Celery's main process passes
        to the backend) goes through :meth:`amend_context` (Celery 5.5–5.7: the private
        ``Request._context``)."""

        def amend_context(self, context: Any) -> None:
            """Add to the context built from the message (does nothing here)."""

        @property
        def _context(self) -> Any:
            context = super()._context
            self.amend_context(context)
            return context

    ContextHookRequest.__module__ = __name__
    return ContextHookRequest


# -- Celery: the gevent pool ---------------------------------------------------------------------

#: Celery 5.6's gevent pool reports its running greenlets as its size (``num_processes``), and
#: ``worker_disable_prefetch`` takes a message only while fewer are reserved than that: an idle
#: worker never takes one. Celery 5.7 reports the pool's limit (5.5 has no such setting).
GEVENT_POOL_CANNOT_DISABLE_PREFETCH = CELERY_VERSION[:2] == (5, 6)


# -- Celery: ignored results --------------------------------------------------------------------

if CELERY_VERSION >= (5, 7):
    from celery.app.task import get_actual_ignore_result
elif CELERY_VERSION >= (5, 6):
    # Celery 5.6: it lives in celery.app.trace.
    from celery.app.trace import get_actual_ignore_result
else:

    def get_actual_ignore_result(task: Any, req: Any) -> bool:
        """Whether a run's result is not stored.

        Celery 5.5 has no such function: its trace skips the write for ``task.ignore_result``,
        and its backend skips a SUCCESS for the request's ``ignore_result`` (an
        ``apply_async(ignore_result=True)``).
        """
        return bool(task.ignore_result or (req is not None and getattr(req, "ignore_result", False)))


def is_request_ignore_result(request: Any) -> bool:
    """Celery's own rule for "this request's SUCCESS is not stored" (private in 5.5–5.7)."""
    return bool(_is_request_ignore_result(request))


# -- Celery: the result backend -----------------------------------------------------------------


class StoreResultHook:
    """Mixed in before Celery's Redis backend: its one write that receives the request
    (Celery 5.5–5.7: the private ``_store_result``) goes to :meth:`store_with_request`, and
    the deletion behind ``AsyncResult.forget()`` (the private ``_forget``, which ``forget()``
    calls in Celery's retry loop) to :meth:`forget_result`."""

    def forget_result(self, task_id: str) -> None:
        """Delete a task's result for ``AsyncResult.forget()``; implemented by the backend."""
        raise NotImplementedError

    def _forget(self, task_id: str) -> None:
        self.forget_result(task_id)

    def store_with_request(
        self, task_id: str, result: Any, state: str, traceback: Any, request: Any, **kwargs: Any
    ) -> Any:
        """Store one write; implemented by the backend."""
        raise NotImplementedError

    def _store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: Any = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        return self.store_with_request(task_id, result, state, traceback, request, **kwargs)


def leave_result_subscriptions(consumer: Any) -> None:
    """Close a Redis result consumer's pubsub and forget what it was subscribed to.

    Its later ``cancel_for`` (from ``AsyncResult.__del__``) then sends nothing: Celery 5.7
    unsubscribes only a key in ``subscribed_to``, and every version only while ``_pubsub`` is
    set (5.5 and 5.6 send UNSUBSCRIBE for any key). Both names are private. Run at interpreter
    exit, before the modules go: a result collected later would otherwise connect again and
    import (redis-py's parser does, on connect), which fails once Python shuts down.
    """
    pubsub = getattr(consumer, "_pubsub", None)
    consumer._pubsub = None
    subscribed = getattr(consumer, "subscribed_to", None)
    if subscribed is not None:
        subscribed.clear()
    pending = getattr(consumer, "_pending_unsubscribe", None)  # Celery 5.7
    if pending is not None:
        pending.clear()
    if pubsub is not None:
        with contextlib.suppress(Exception):
            pubsub.close()


def result_meta(backend: Any, result: Any, state: str, traceback: Any, request: Any) -> dict[str, Any]:
    """The meta Celery stores for a write (``BaseBackend._get_result_meta``, private)."""
    meta: dict[str, Any] = backend._get_result_meta(result=result, state=state, traceback=traceback, request=request)
    return meta


def call_errbacks(backend: Any, request: Any, exc: Any, traceback: Any) -> None:
    """Call a failed task's errbacks as Celery does (``BaseBackend._call_task_errbacks``, private)."""
    backend._call_task_errbacks(request, exc, traceback)


def failure_expires(backend: Any) -> Any:
    """The expiry of a FAILURE result: ``result_failure_expires`` exists from Celery 5.7 on;
    before it a FAILURE expires as every result does."""
    return getattr(backend, "failure_expires", backend.expires)


def fail_chain(
    backend: Any, chain: Any, exc: Any, traceback: Any = None, *, store_result: bool = True, state: str = states.FAILURE
) -> None:
    """Store ``exc`` for the tasks chained after a failed one, as Celery does after a FAILURE.

    Celery 5.7 has this as ``BaseBackend._fail_chain`` (private). Celery 5.5 and 5.6 run it
    inside ``mark_as_failure``; this is that loop, as they have it.
    """
    own = getattr(backend, "_fail_chain", None)
    if own is not None:
        own(chain, exc, traceback, store_result=store_result, state=state)
        return
    try:
        chain_data = iter(chain)
    except (AttributeError, TypeError):
        chain_data = iter(())
    for chain_elem in chain_data:
        chain_elem_ctx = Context(chain_elem)
        chain_elem_ctx.update(chain_elem_ctx.options)
        chain_elem_ctx.id = chain_elem_ctx.options.get("task_id")
        chain_elem_ctx.group = chain_elem_ctx.options.get("group_id")
        if store_result and state in states.PROPAGATE_STATES and chain_elem_ctx.task_id is not None:
            backend.store_result(chain_elem_ctx.task_id, exc, state, traceback=traceback, request=chain_elem_ctx)
        if "chord" in chain_elem_ctx.options:
            backend.on_chord_part_return(chain_elem_ctx, state, exc)
