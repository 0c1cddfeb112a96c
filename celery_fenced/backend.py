"""``FencedRedisBackend``: Celery's Redis result backend with every write fenced.

Use it with ``result_backend = "fenced+redis://host:6379/1"`` (``rediss://`` and
``unix://`` work the same). Every write for a task id goes through ``store.lua``: it is
stored only when the writer's fencing token is the current one, and a READY state ends the
lease in the same atomic step. Tasks without a lease (plain tasks) are written exactly as
Celery's Redis backend writes them, with its "a stored SUCCESS is final" rule made atomic.

A refused write is dropped, logged and counted; it never raises into Celery's trace and
runs none of the side effects Celery attaches to a write (chord part counting, errbacks,
failing the rest of a chain).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from functools import cached_property, partial
from typing import Any, TypeVar

from celery import states
from celery.backends.base import _is_request_ignore_result
from celery.backends.redis import RedisBackend, SentinelBackend
from celery.exceptions import TaskRevokedError
from kombu.utils.encoding import bytes_to_str

from . import events, reaper, signals
from .conf import ensure_conf
from .exceptions import TaskAbandonedError
from .keys import KeySpace
from .lease import LeaseStore, StoreResult
from .metrics import buffer as metrics
from .metrics import count_lease_activity
from .owner import OwnedLease

__all__ = ["REFUSED_WRITES", "FencedRedisBackend", "FencedSentinelBackend"]

logger = logging.getLogger("celery_fenced.backend")

T = TypeVar("T")

#: store.lua codes that mean "nothing was written": Celery's write side effects are skipped.
REFUSED_WRITES = frozenset({"stale", "finished", "lapsed", "foreign"})


def _is_worker_lost(result: Any) -> bool:
    if isinstance(result, dict):
        return result.get("exc_type") == "WorkerLostError"
    return type(result).__name__ == "WorkerLostError"


def _global_keyprefix(app: Any) -> str:
    options = app.conf.get("result_backend_transport_options") or {}
    prefix = options.get("global_keyprefix") or ""
    if prefix and prefix[-1] not in ":_-.":
        prefix += "_"  # the same rule Celery applies to its own keys
    return str(prefix)


class FencedRedisBackend(RedisBackend):
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
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        conf = ensure_conf(self.app)
        self.keyspace = KeySpace.build(conf.key_prefix, bytes_to_str(self.task_keyprefix), _global_keyprefix(self.app))

    @cached_property
    def lease_store(self) -> LeaseStore:
        """The lease store over this backend's Redis client."""
        return LeaseStore(self.client, self.keyspace)

    def retrying(self, operation: Callable[[], T]) -> T:
        """Run ``operation`` once; on a connection error, go on in Celery's retry loop.

        :meth:`ensure` would set up its retry loop for every call, which costs more than
        the lease script it wraps; this sets it up only once a call has failed.
        """
        try:
            return operation()
        except self.connection_errors:
            result: T = self.ensure(operation, ())
            return result

    # -- the fenced write -------------------------------------------------------------------

    def _store_result(
        self,
        task_id: str,
        result: Any,
        state: str,
        traceback: Any = None,
        request: Any = None,
        **kwargs: Any,
    ) -> Any:
        if request is not None and getattr(request, "fenced_skip", None):
            # A duplicate or finished delivery: its writes (STARTED included) go nowhere.
            return result
        if request is not None and state == states.SUCCESS and getattr(request, "fenced_result_stored", False):
            return result  # already stored through the fence by the task itself
        owned: OwnedLease | None = getattr(request, "fenced_lease", None)
        meta = self._get_result_meta(result=result, state=state, traceback=traceback, request=request)
        meta["task_id"] = bytes_to_str(task_id)
        if owned is not None:
            meta["fence_token"] = owned.token
        if state in states.READY_STATES:
            kind = "ready"
        elif state == states.RETRY:
            kind = "retry"
        else:
            kind = "other"
        conf = ensure_conf(self.app)
        retry_delay = float(getattr(request, "fenced_retry_delay", 0) or 0)
        worker_lost = owned is None and state == states.FAILURE and _is_worker_lost(result)
        store = partial(
            self.lease_store.store,
            task_id,
            owned.token if owned is not None else None,
            self.encode(meta),
            state=state,
            kind=kind,
            expires_ms=self._expires_ms(state),
            retry_due_ms=int((retry_delay + conf.requeue_timeout) * 1000),
            writer_host=str(getattr(request, "hostname", "") or ""),
            worker_lost=worker_lost,
        )
        outcome: StoreResult = self.retrying(store)
        if request is not None:
            with contextlib.suppress(AttributeError):  # a request that takes no attributes
                request.fenced_write = outcome.code
        self._after_store(task_id, state, owned, outcome)
        return result

    def _after_store(self, task_id: str, state: str, owned: OwnedLease | None, outcome: StoreResult) -> None:
        code = outcome.code
        if code == "stored":
            if owned is not None and outcome.detail in ("DONE", "RETRYING"):
                owned.ended = True
                count_lease_activity(owned, ended=True)
                if state == states.SUCCESS:
                    metrics.observe("owner_task_total_duration_seconds", time.monotonic() - owned.started)
            return
        name = owned.task_name if owned is not None else None
        if code == "stale":
            current = int(outcome.detail) if outcome.detail.isdigit() else None
            logger.warning(
                "stale write dropped: task %s[%s] state=%s stage=%s token=%s current token=%s",
                name,
                task_id,
                state,
                owned.stage if owned is not None else None,
                owned.token if owned is not None else None,
                current,
            )
            self._count_stale_write(task_id, state, owned, current)
            signals.stale_write_rejected.send(
                sender=name,
                task_id=task_id,
                token=owned.token if owned is not None else None,
                current_token=current,
                state=state,
            )
        elif code == "lapsed":
            logger.warning("worker lost while running task %s: lease lapsed, the task will be taken over", task_id)
            reaper.request_reap(self.app)
        else:
            logger.info("write of %s for task %s dropped: %s (%s)", state, task_id, code, outcome.detail)

    def _count_stale_write(self, task_id: str, state: str, owned: OwnedLease | None, current: int | None) -> None:
        metrics.inc("owner_fencing_rejected_total")
        if owned is None:
            metrics.flush(self.lease_store)
            return
        owned.mark_lost("fenced: a newer token owns the task")
        if state == states.SUCCESS:
            # The old owner of a takeover finished after all: its deadline was too tight.
            lease = self.lease_store.read(task_id)
            if lease is not None and lease.takeovers > 0 and "cancelledAt" not in lease.raw:
                metrics.inc("owner_false_takeover_total")
        metrics.flush(self.lease_store)
        events.send(
            self.app,
            "task-fenced",
            task_id=task_id,
            token=owned.token,
            stage=owned.stage,
            attempt=owned.attempt,
            current_token=current,
            state=state,
        )

    def _expires_ms(self, state: str) -> int:
        expires = self.failure_expires if state == states.FAILURE else self.expires
        return int(expires * 1000) if expires else 0

    @staticmethod
    def _refused(request: Any) -> bool:
        if request is None:
            return False
        return bool(getattr(request, "fenced_skip", None)) or (getattr(request, "fenced_write", None) in REFUSED_WRITES)

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
        if store_result and not _is_request_ignore_result(request):
            self.store_result(task_id, result, state, request=request)
        if self._refused(request):
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
        """Store a FAILURE; a refused write runs no chord, chain or errback side effect."""
        if store_result:
            self.store_result(task_id, exc, state, traceback=traceback, request=request)
        if self._refused(request):
            return
        super().mark_as_failure(
            task_id,
            exc,
            traceback=traceback,
            request=request,
            store_result=False,
            call_errbacks=call_errbacks,
            state=state,
        )

    def mark_as_revoked(
        self,
        task_id: str,
        reason: str = "",
        request: Any = None,
        store_result: bool = True,
        state: str = states.REVOKED,
    ) -> None:
        """Store a REVOKED; a refused write does not count a chord part."""
        if store_result:
            self.store_result(task_id, TaskRevokedError(reason), state, traceback=None, request=request)
        if self._refused(request):
            return
        super().mark_as_revoked(task_id, reason, request=request, store_result=False, state=state)

    # -- metas written by the reaper and the cancel command ---------------------------------

    def encoded_meta(self, task_id: str, exc: BaseException, state: str, token: int) -> Any:
        """Encode a READY meta for ``exc``, carrying ``token`` as ``fence_token``."""
        meta = self._get_result_meta(result=self.encode_result(exc, state), state=state, traceback=None, request=None)
        meta["task_id"] = task_id
        meta["fence_token"] = token
        return self.encode(meta)

    def abandoned_meta(self, task_id: str, token: int) -> Any:
        """The FAILURE stored for a task taken over too often."""
        exc = TaskAbandonedError(f"task {task_id} was taken over too many times and is abandoned")
        return self.encoded_meta(task_id, exc, states.FAILURE, token)

    def failure_expires_ms(self) -> int:
        """The expiry of a FAILURE result in milliseconds (0: none)."""
        return self._expires_ms(states.FAILURE)


class FencedSentinelBackend(FencedRedisBackend, SentinelBackend):
    """The fenced backend over Redis Sentinel: ``fenced+sentinel://host:26379;sentinel://…/db``.

    Give the master's name as Celery does, in ``result_backend_transport_options``
    (``{"master_name": "mymaster"}``).
    """
