"""``FencedRedisBackend``: Celery's Redis result backend with every write fenced.

Use it with ``result_backend = "fenced+redis://host:6379/1"`` (``rediss://`` and
``unix://`` work the same). Every write for a task id goes through ``store.lua``: it is
stored only when the writer's fencing token is the current one, and a READY state ends the
lease in the same atomic step. Tasks without a lease (plain tasks) are written exactly as
Celery's Redis backend writes them, with its "a stored SUCCESS is final" rule made atomic.

A refused write is dropped; it never raises into Celery's trace and runs none of the side
effects Celery attaches to a write (chord part counting, errbacks, failing the rest of a
chain). The backend only stores: each outcome goes to its app's write hook
(:mod:`celery_fenced._backend.writes`), which logs it, and in a worker also ends or loses the
writer's lease, counts it and asks for a reap.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from functools import cached_property, partial
from typing import Any
from urllib.parse import urlsplit

from celery import states
from celery.app.task import Context
from celery.backends.redis import RedisBackend, SentinelBackend
from celery.exceptions import TaskRevokedError
from celery.utils.time import humanize_seconds
from kombu.utils.functional import retry_over_time
from kombu.utils.url import maybe_sanitize_url

from .._celery.apps import record_of
from .._celery.compat import (
    StoreResultHook,
    call_errbacks,
    fail_chain,
    failure_expires,
    is_request_ignore_result,
    leave_result_subscriptions,
    result_meta,
)
from .._celery.headers import HANDED_OFF_BY_HEADER
from .._lease.finished import FENCE_RUN, run_text
from .._lease.gateway import Retry, threads_are_greenlets
from .._lease.keys import KeySpace
from .._lease.state import as_text
from .._lease.store import LeaseStore
from ..conf import ensure_conf, forget_window
from ..exceptions import ConfigurationError, TaskAbandonedError
from .fence import fence_of
from .writes import WriteReport, log_write

__all__ = [
    "CANCELLED",
    "PUT_BACK",
    "REDIS_SCHEMES",
    "REFUSED_WRITES",
    "FencedRedisBackend",
    "FencedSentinelBackend",
    "celery_retry",
    "check_redis_url",
    "request_of_call",
]

logger = logging.getLogger("celery_fenced.backend")

#: The attribute of a main-process write's request that says Celery cancelled the task's
#: request: its body never finished (set by the worker's request class).
CANCELLED = "fenced_cancelled"

#: The attribute of a main-process write's request that says Celery puts the task's message
#: back after this write (a hard time limit with ``task_acks_late`` and
#: ``acks_on_failure_or_timeout`` off): the message runs the task again, as in Celery.
PUT_BACK = "fenced_put_back"

#: store.lua codes that mean "nothing was written": Celery's write side effects are skipped.
REFUSED_WRITES = frozenset({"stale", "finished", "lapsed", "foreign", "missing"})


#: Every fenced backend of this process, whose result subscriptions are left at exit.
_LIVE_BACKENDS: weakref.WeakSet[FencedRedisBackend] = weakref.WeakSet()
_exit_hook: list[bool] = []  # registered once per process (a forked child inherits it)


def _leave_results_at_exit(backend: FencedRedisBackend) -> None:
    """Leave ``backend``'s result subscriptions when the interpreter exits.

    A client that waited on a result may still hold its ``AsyncResult`` when Python shuts
    down; collected then, it unsubscribes, which reconnects and imports after imports are
    gone (``Exception ignored in: AsyncResult.__del__ … sys.meta_path is None``). Left at
    exit, while the interpreter is whole, the pubsub is closed and nothing is sent later.
    """
    _LIVE_BACKENDS.add(backend)
    if not _exit_hook:
        _exit_hook.append(True)
        atexit.register(_leave_every_result)


def _leave_every_result() -> None:
    for backend in list(_LIVE_BACKENDS):
        consumer = getattr(backend, "result_consumer", None)
        if consumer is not None:
            leave_result_subscriptions(consumer)


def _is_worker_lost(result: Any) -> bool:
    if isinstance(result, dict):
        return result.get("exc_type") == "WorkerLostError"
    return type(result).__name__ == "WorkerLostError"


def _stopped_unfinished(state: str, result: Any, request: Any) -> bool:
    """A tokenless write that says the owner's body stopped without finishing: Celery's
    ``WorkerLostError``, or the RETRY it writes for a request it cancelled (a cold shutdown)."""
    if state == states.FAILURE:
        return _is_worker_lost(result)
    return state == states.RETRY and bool(getattr(request, CANCELLED, False))


def request_of_call(task_id: str, call: Mapping[str, Any]) -> Context:
    """A request rebuilt from a recorded call: enough for Celery's chord, chain and errback code."""
    options = call.get("options") or {}
    return Context(
        id=task_id,
        task=call.get("task"),
        args=list(call.get("args") or ()),
        kwargs=dict(call.get("kwargs") or {}),
        root_id=options.get("root_id"),
        parent_id=options.get("parent_id"),
        group=options.get("group_id"),
        group_index=options.get("group_index"),
        chord=options.get("chord"),
        chain=options.get("chain"),
        callbacks=options.get("link"),
        errbacks=options.get("link_error"),
        delivery_info={"is_eager": False},
    )


def _main_process_retry_delay(app: Any, request: Any) -> float:
    """The countdown of the retry Celery's main process sends with a tokenless RETRY: Celery
    5.7's ``retry_on_worker_lost`` retries a task whose process was lost after the task's
    ``default_retry_delay``. The lease waits for that message, as for ``self.retry()``."""
    task = app.tasks.get(getattr(request, "task", None) or "")
    try:
        return max(0.0, float(getattr(task, "default_retry_delay", None) or 0))
    except (TypeError, ValueError):
        return 0.0


def _main_process_writer(request: Any) -> str:
    """``"<hostname>/<pid>/"``, the owner-id prefix of the process that ran a tokenless write's
    task; ``""`` when no process ran it (a copy revoked or expired before it started)."""
    hostname = getattr(request, "hostname", None)
    pid = getattr(request, "worker_pid", None)
    return f"{hostname}/{pid}/" if hostname and pid else ""


def _global_keyprefix(app: Any) -> str:
    options = app.conf.get("result_backend_transport_options") or {}
    prefix = options.get("global_keyprefix") or ""
    if prefix and prefix[-1] not in ":_-.":
        prefix += "_"  # the same rule Celery applies to its own keys
    return str(prefix)


#: The URL schemes after ``fenced+`` that name a Redis server (the lease store is Redis).
REDIS_SCHEMES = ("redis", "rediss", "sentinel", "socket", "unix")


def check_redis_url(url: Any) -> None:
    """Refuse a ``fenced+`` URL whose inner scheme is not a Redis one (it would be read as Redis)."""
    if not url:
        return
    scheme, _, rest = str(url).partition("://")
    scheme = scheme.lower()
    if scheme not in REDIS_SCHEMES:
        raise ConfigurationError(
            f"result_backend 'fenced+{scheme}://…' is not a Redis URL: the leases live in Redis, so use "
            + ", ".join(f"fenced+{name}://" for name in REDIS_SCHEMES[:3])
        )
    if scheme in ("redis", "rediss"):
        try:
            _ = urlsplit(f"{scheme}://{rest}").port  # read, it checks the port
        except ValueError as exc:  # a port that is no number, or out of range
            shown = re.sub(r"(//[^:/@]*:)[^@/]*@", r"\1**@", f"fenced+{scheme}://{rest}")
            raise ConfigurationError(f"result_backend {shown} has no valid port: {exc}") from None
    if scheme in ("redis", "rediss"):
        server, slash, path = rest.partition("?")[0].partition("/")
        numbers = [part for part in path.split("/") if part]
        if slash and (len(numbers) > 1 or (numbers and not numbers[0].isdigit())):
            shown = maybe_sanitize_url(f"fenced+{scheme}://{server}/{path}")
            instead = maybe_sanitize_url(f"fenced+{scheme}://{server}/{numbers[-1]}")
            raise ConfigurationError(
                f"result_backend {shown} names the database as {'/' + path!r}: a Redis URL ends in one "
                f"database number, as in {instead} (a server URL that already ends in a database "
                "number must not be given another)"
            )


def celery_retry(errors: tuple[type[BaseException], ...], policy: Mapping[str, Any]) -> Retry:
    """A :class:`~celery_fenced._lease.gateway.Retry` that runs a call again as Celery's Redis backend
    does (its ``ensure``): ``policy`` is its ``retry_policy`` (``max_retries``, ``interval_start``,
    ``interval_step``, ``interval_max``), and each retry is logged as Celery logs it."""
    max_retries = policy.get("max_retries")

    def lost(exc: BaseException, intervals: Iterator[float], retries: int) -> float:
        wait = next(intervals)
        logger.error(
            "Connection to Redis lost: Retry (%s/%s) %s.", retries, max_retries or "Inf", humanize_seconds(wait, "in ")
        )
        return wait

    def again(operation: Callable[[], Any]) -> Any:
        return retry_over_time(operation, errors, (), {}, lost, **policy)  # type: ignore[no-untyped-call]

    return Retry(errors, again)


class FencedRedisBackend(StoreResultHook, RedisBackend):
    """Celery's Redis result backend, with every write fenced by the task's token.

    The leases live beside the results, in this backend's Redis (same server, same
    database), so a result write and the end of its lease are one script.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> FencedRedisBackend:
        # "fenced+sentinel://…" reaches this class with url="sentinel://…": serve it with
        # the Sentinel variant, so one entry point covers every Redis URL form.
        url = str(kwargs.get("url") or "")
        if cls is FencedRedisBackend and url.startswith("sentinel"):
            cls = FencedSentinelBackend
        backend: FencedRedisBackend = super().__new__(cls)
        return backend

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        check_redis_url(kwargs.get("url"))
        super().__init__(*args, **kwargs)
        conf = ensure_conf(self.app)
        self.keyspace = KeySpace.build(conf.key_prefix, as_text(self.task_keyprefix), _global_keyprefix(self.app))
        self._record = record_of(self.app)  # where the app's write hook is kept
        _leave_results_at_exit(self)

    def as_uri(self, include_password: bool = False) -> str:
        """The backend's URL as Celery shows it (the worker's banner), with its ``fenced+``."""
        uri: str = super().as_uri(include_password)
        return uri if uri.startswith("fenced+") else f"fenced+{uri}"

    @cached_property
    def lease_store(self) -> LeaseStore:
        """The lease store over this backend's Redis client.

        Where the process's threads are greenlets (the gevent pool), Celery makes a backend for
        each thread, that is for each task's greenlet: those of one app share one store, over
        the first one's client and its pool, made again only for another Redis or keyspace.
        """
        if not threads_are_greenlets():
            return LeaseStore(self.client, self.keyspace, retry=self._retry)
        made_for = (os.getpid(), self.as_uri(include_password=True), self.keyspace)
        shared = self._record.shared_store
        if shared is None or shared[0] != made_for:
            shared = self._record.shared_store = (made_for, LeaseStore(self.client, self.keyspace, retry=self._retry))
        store: LeaseStore = shared[1]
        return store

    @property
    def _retry(self) -> Retry:
        """The store's retry policy: after a connection error, the loop of :meth:`ensure`, with
        this backend's ``retry_policy`` (built apart from the backend: a store shared by the
        backends of greenlets outlives the one that made it, and holds no backend)."""
        return celery_retry(tuple(self.connection_errors), dict(self.retry_policy))

    # -- the fenced write -------------------------------------------------------------------

    def store_with_request(
        self, task_id: str, result: Any, state: str, traceback: Any, request: Any, **kwargs: Any
    ) -> Any:
        """Store one write through the fence (Celery's one write that receives the request).

        The write carries the token of the :class:`~celery_fenced._backend.fence.WriterFence`
        the worker put on ``request`` at acquire; a request without one writes without.
        """
        fence = fence_of(request)
        if fence is not None:
            if fence.skipped:
                # A duplicate or finished delivery: its writes (STARTED included) go nowhere.
                return result
            if state == states.SUCCESS and fence.result_stored:
                return result  # already stored through the fence by the task itself
            if state == states.STARTED and fence.started_stored and fence.task_id == task_id:
                return result  # stored by the acquire, in the same call (started_head())
        token = fence.token if fence is not None and fence.task_id == task_id else None
        meta = result_meta(self, result, state, traceback, request)
        meta["task_id"] = as_text(task_id)
        if state in states.READY_STATES:
            kind = "ready"
        elif state == states.RETRY:
            kind = "retry"
        else:
            kind = "other"
        if fence is not None and token is not None:
            run = run_text(fence.publish_id, fence.attempt, fence.takeovers) if kind == "ready" else None
            if run is not None:
                # The finished lease's compact form: the result carries its fence, last
                # (celery_fenced._lease.finished), and the lease hash is deleted with the write.
                meta[FENCE_RUN] = run
            meta["fence_token"] = token
        conf = ensure_conf(self.app)
        if fence is not None:
            retry_delay = fence.retry_delay
        elif kind == "retry":
            retry_delay = _main_process_retry_delay(self.app, request)
        else:
            retry_delay = 0.0
        write = partial(
            self.lease_store.store,
            task_id,
            token,
            self.encode(meta),
            state=state,
            kind=kind,
            expires_ms=self.expires_ms(state),
            retry_due_ms=int((retry_delay + conf.requeue_timeout) * 1000),
            writer=_main_process_writer(request) if token is None else "",
            worker_lost=token is None and _stopped_unfinished(state, result, request),
            put_back=token is None and kind == "ready" and bool(getattr(request, PUT_BACK, False)),
            owner_id=fence.owner_id if fence is not None and token is not None else "",
            handed_off_by=str(getattr(request, HANDED_OFF_BY_HEADER, None) or "") if token is None else "",
        )
        hook = self._record.write_hook or log_write
        outcome = write()
        self._last_write.outcome = (task_id, outcome.code)
        if hook(self, WriteReport(task_id, state, token, outcome, request)):
            # The writer's lease had vanished (the store lost data) and its owner has it back
            # (the hook wrote it back): the write is made again, once.
            outcome = write()
            self._last_write.outcome = (task_id, outcome.code)
            hook(self, WriteReport(task_id, state, token, outcome, request))
        return result

    def forget_result(self, task_id: str) -> None:
        """``AsyncResult.forget()``: the result goes, not the fact that the task is done.

        A finished task keeps a small DONE tombstone for :func:`~celery_fenced.conf.forget_window`
        (a late copy of its message does not run, a late write is refused); see ``forget.lua``.
        """
        window_ms = int(forget_window(self.app) * 1000)
        self.lease_store.forget(task_id, keep_ms=window_ms)

    @cached_property
    def _last_write(self) -> threading.local:
        """Per thread, ``(task id, outcome code)`` of the last write: Celery's side effects
        after a write run only if it was not refused."""
        return threading.local()

    def started_head(self, task_id: str, request: Any, hostname: str) -> str:
        """The STARTED meta Celery's trace writes for ``request`` (``task_track_started``),
        encoded as :meth:`store_with_request` encodes it but for its end: the acquire appends
        ``, "fence_token": <token>}`` and stores it in the call that takes the lease. ``""``
        where the result serializer is not JSON (the trace's own write then stores it)."""
        if self.serializer != "json":
            return ""
        result = self.encode_result({"pid": os.getpid(), "hostname": hostname}, states.STARTED)
        meta = result_meta(self, result, states.STARTED, None, request)
        meta["task_id"] = as_text(task_id)
        encoded = as_text(self.encode(meta))
        return encoded[:-1] if encoded.endswith("}") and len(encoded) > 2 else ""

    def expires_ms(self, state: str) -> int:
        """How long a result in ``state`` is kept, in milliseconds (0: for ever)."""
        expires = failure_expires(self) if state == states.FAILURE else self.expires
        return int(expires * 1000) if expires else 0

    def _refused(self, task_id: str, request: Any) -> bool:
        """The write just made for ``task_id`` (or the delivery's writes) went nowhere."""
        fence = fence_of(request)
        if fence is not None and fence.skipped:
            return True
        last = getattr(self._last_write, "outcome", None)
        return last is not None and last[0] == task_id and last[1] in REFUSED_WRITES

    # -- Celery's write entry points: no side effects after a refused write -----------------

    def mark_as_done(
        self,
        task_id: str,
        result: Any,
        request: Any = None,
        store_result: bool = True,
        state: str = states.SUCCESS,
    ) -> None:
        """Store a SUCCESS; a refused write does not count a chord part."""
        self._last_write.outcome = None
        if store_result and not is_request_ignore_result(request):
            self.store_result(task_id, result, state, request=request)
        if self._refused(task_id, request):
            return
        if request and request.chord:
            self.on_chord_part_return(request, state, result)

    def mark_as_failure(
        self,
        task_id: str,
        exc: Any,
        traceback: Any = None,
        request: Any = None,
        store_result: bool = True,
        call_errbacks: bool = True,
        state: str = states.FAILURE,
    ) -> None:
        """Store a FAILURE; a refused write runs no chord, chain or errback side effect.

        The side effects are Celery's own (``BaseBackend.mark_as_failure``), run here after
        the fenced write: the chord part, the FAILURE of every later chain step (stored as
        Celery stores it, unless results are not stored), and the errbacks.
        """
        self._last_write.outcome = None
        if store_result:
            self.store_result(task_id, exc, state, traceback=traceback, request=request)
        if self._refused(task_id, request) or not request:
            return
        self.failure_side_effects(request, exc, state, traceback, store_chain=store_result, errbacks=call_errbacks)

    def failure_side_effects(
        self,
        request: Any,
        exc: Any,
        state: str = states.FAILURE,
        traceback: Any = None,
        *,
        store_chain: bool = True,
        errbacks: bool = True,
    ) -> None:
        """What Celery does after it stores a FAILURE: count the chord part, store the
        FAILURE of every later chain step, call the errbacks."""
        if request.chord:
            self.on_chord_part_return(request, state, exc)
        fail_chain(self, getattr(request, "chain", None), exc, traceback, store_result=store_chain, state=state)
        if errbacks and request.errbacks:
            call_errbacks(self, request, exc, traceback)

    def ended_without_owner(self, task_id: str, call: Any, exc: BaseException, state: str) -> None:
        """Run Celery's side effects for a READY state stored without an owner's write.

        The reaper's ABANDONED, ``celery fenced cancel`` and the ``fenced_max_task_duration``
        stop store their result in a script of their own; the chord part, later chain steps
        and errbacks of the task still need what Celery would do after such a write. The
        request is rebuilt from the call recorded at acquire. Called once per task: by the
        one caller whose script stored the result.
        """
        if not call:
            logger.warning("task %s has no recorded call: its chord, chain and errbacks are not run", task_id)
            return
        request = request_of_call(task_id, call)
        try:
            if state == states.REVOKED:
                if request.chord:
                    self.on_chord_part_return(request, state, exc)
            else:
                self.failure_side_effects(request, exc, state)
        except Exception:
            logger.exception("could not run the chord, chain and errback side effects of task %s", task_id)

    def mark_as_revoked(
        self,
        task_id: str,
        reason: str = "",
        request: Any = None,
        store_result: bool = True,
        state: str = states.REVOKED,
    ) -> None:
        """Store a REVOKED; a refused write does not count a chord part."""
        self._last_write.outcome = None
        if store_result:
            self.store_result(task_id, TaskRevokedError(reason), state, traceback=None, request=request)
        if self._refused(task_id, request):
            return
        super().mark_as_revoked(task_id, reason, request=request, store_result=False, state=state)

    # -- metas written by the reaper and the cancel command ---------------------------------

    def encoded_meta(self, task_id: str, exc: BaseException, state: str, token: int) -> Any:
        """Encode a READY meta for ``exc``, carrying ``token`` as ``fence_token``."""
        meta = result_meta(self, self.encode_result(exc, state), state, None, None)
        meta["task_id"] = task_id
        meta["fence_token"] = token
        return self.encode(meta)

    def abandoned_meta(self, task_id: str, token: int) -> Any:
        """The FAILURE stored for a task taken over too often."""
        return self.encoded_meta(task_id, TaskAbandonedError.of(task_id), states.FAILURE, token)

    def failure_expires_ms(self) -> int:
        """The expiry of a FAILURE result in milliseconds (0: none)."""
        return self.expires_ms(states.FAILURE)


class FencedSentinelBackend(FencedRedisBackend, SentinelBackend):
    """The fenced backend over Redis Sentinel: ``fenced+sentinel://host:26379;sentinel://…/db``.

    Give the master's name as Celery does, in ``result_backend_transport_options``
    (``{"master_name": "mymaster"}``).
    """
