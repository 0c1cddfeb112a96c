"""The life of an attempt's lease in a worker process: take it, serve it, end it.

* :func:`acquire` takes the lease before the body runs (from ``task_prerun``), so Celery's
  STARTED write already carries the token; a duplicate or finished delivery is marked to be
  skipped.
* The process's :class:`~celery_fenced.heartbeat.Heartbeat` serves every lease it holds;
  :class:`~celery_fenced.worker.listener.WorkerListener` turns what it finds into signals,
  events, reaps and interrupts.
* The body ends it by a result write (see :meth:`~celery_fenced.worker.attempt.Attempt.result_written`),
  or hands it to a replacement (:func:`hand_off`) or a retry (:func:`retry_due`).
* :func:`run_body` runs the body under the lease, and decides what a lost owner's ending is.
* :func:`release` ends a lease that no result write ended (ignored results, ``Ignore``,
  ``Reject``, retries with ignored results).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any, NoReturn

from celery import Celery
from celery import states as celery_states
from celery.exceptions import Ignore, Reject
from redis.exceptions import RedisError

from .. import events, tracing
from .. import signals as fenced_signals
from ..calls import PUBLISH_ID_HEADER, next_attempt_id, recorded_call
from ..compat import get_actual_ignore_result
from ..conf import TaskPolicy, ensure_conf
from ..exceptions import LeaseInterrupted, LeaseLostError, StaleOwnerError
from ..heartbeat import Heartbeat
from ..owner import OwnedLease, current_lease, set_current_lease
from ..running import RunningAttempt
from ..state import LeaseStatus, ReleaseOutcome
from ..store import lease_store_of
from .attempt import Attempt, announce_the_end, attempt_of
from .interrupt import body_runner, end_of_body
from .runtime import runtime_of, runtimes

__all__ = [
    "acquire",
    "hand_off",
    "heartbeat_for",
    "release",
    "retry_due",
    "run_body",
    "send_again",
    "still_owner",
    "stop_heartbeats",
    "store_late_result",
    "store_rejection",
]

logger = logging.getLogger(__name__)

# -- the heartbeat of this process -------------------------------------------------------------


def heartbeat_for(app: Celery, create: bool = True) -> Heartbeat | None:
    """This process's heartbeat for ``app`` (created on first use; a forked child makes its own)."""
    runtime = runtime_of(app, create)
    return runtime.heartbeat(create) if runtime is not None else None


def stop_heartbeats() -> None:
    """Stop and join every heartbeat of this process."""
    for runtime in runtimes():
        heartbeat = runtime.heartbeat(create=False)
        if heartbeat is not None:
            heartbeat.stop()


def run_body(
    task: Any, request: Any, attempt: RunningAttempt, call_body: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """Run the body of ``task``'s attempt of ``request`` (``ProgressLeasedTask.__call__`` in a worker).

    ``call_body`` is Celery's ``Task.__call__`` (a body that runs without a lease). A lost
    owner stores nothing (its ending is ``Ignore``), unless nobody took over and its late
    result can still land through the fence.
    """
    assert isinstance(attempt, Attempt)  # the worker side made every attempt of this process
    if attempt.error is not None:
        raise attempt.error
    if attempt.skip == "unavailable":
        send_again(task, request)
        raise Ignore()
    if attempt.skip:
        raise Ignore()
    lease = attempt.lease
    if lease is None:
        return call_body(*args, **kwargs)
    _describe_on_span(task, request, lease)
    try:
        try:
            # The worker's tracer has pushed this task and its request already; Task.__call__
            # would push a copy of the request around the body for nothing.
            retval = task.run(*args, **kwargs)
        finally:
            # An interrupt sent and not landed is withdrawn here; one that lands while this
            # runs is handled below like one in the body.
            end_of_body(lease)
    except LeaseInterrupted as exc:
        # Interrupted: a lost owner stores nothing; the new owner, or the reaper's re-send,
        # finishes the task.
        raise Ignore() from exc
    except Reject as exc:
        attempt.reject_requeue = bool(exc.requeue)
        if not exc.requeue and lease.lost_reason is None and not lease.ended:
            store_rejection(task, request, exc)
        raise
    except Exception as exc:
        if isinstance(exc, StaleOwnerError) and lease.lost_reason is None and still_owner(task, lease):
            # One of the body's own fenced writes met a newer token of another task: the
            # task still owns its lease, so this is its error, stored as its FAILURE.
            raise
        if lease.lost_reason is not None or isinstance(exc, LeaseLostError):
            # The lease is gone (or may be): a lost owner stores nothing, not even its error.
            raise Ignore() from exc
        raise
    if lease.lost_reason is None:
        with contextlib.suppress(LeaseLostError):
            lease.raise_if_lost()  # marks the lease lost when no renewal came within the TTL
    if lease.lost_reason is None and (request.callbacks or request.chain or request.chord):
        # Celery sends callbacks and the next chain step *before* it stores the result,
        # so the store's fence alone cannot stop a zombie's chain: check now.
        still_owner(task, lease)
    if lease.lost_reason is not None and not store_late_result(task, attempt, request, retval):
        # A stale owner ends as Ignore: nothing stored, nothing sent, and no task-succeeded
        # event that would show the task on the zombie's worker again.
        raise Ignore()
    return retval


def _describe_on_span(task: Any, request: Any, lease: OwnedLease) -> None:
    """Put the attempt on its ``run/<task>`` span (where OpenTelemetry records one), and keep
    the span's context on the lease, for the links of a takeover."""
    traceparent = tracing.attempt_began(lease, request)
    if traceparent is None:
        return
    try:
        task.backend.lease_store.keep_trace_context(lease.task_id, lease.token, traceparent)
    except RedisError:
        # Only a takeover's link to this attempt is lost; the heartbeat tells of the outage.
        logger.debug("could not keep the trace context of task %s", lease.task_id, exc_info=True)


def still_owner(task: Any, lease: OwnedLease) -> bool:
    """Check synchronously (one Redis read) that ``lease`` still owns its task."""
    try:
        lease.raise_if_lost()
        current = task.backend.lease_store.owner_token(lease.task_id)
    except LeaseLostError:
        current = None
    except RedisError as exc:
        logger.warning("could not verify the lease of task %s: %r", lease.task_id, exc)
        current = None
    if current is not None and current[1] == lease.token and current[0] in ("RUNNING", "STALLED"):
        return True
    lease.mark_lost("not the owner after the body returned")
    logger.warning(
        "lease lost: task %s[%s] token=%s: callbacks and chain not sent, result not stored (%s)",
        lease.task_name,
        lease.task_id,
        lease.token,
        lease.lost_reason,
    )
    return False


def store_late_result(task: Any, attempt: Attempt, request: Any, retval: Any) -> bool:
    """Try the result of an owner whose lease was lost through the fence; True if it landed.

    It lands only if no newer token owns the task (the loss was local: no renewal came
    within the TTL, but nobody took over). A refused write is logged, counted and reported
    by the backend like any stale write.
    """
    if get_actual_ignore_result(task, request):
        return False
    try:
        task.backend.store_result(request.id, retval, celery_states.SUCCESS, request=request)
    except Exception:
        logger.exception("could not store the late result of task %s", request.id)
        return False
    if attempt.write == "stored":
        attempt.result_stored = True  # the trace's own write of it is skipped
        return True
    return False


def _stop_serving(task: Any, lease: OwnedLease, heartbeat: Heartbeat | None = None) -> bool:
    """The attempt ends its lease itself: no more renewals; False if it already ended or was lost.

    ``heartbeat`` is the one serving it, when the caller knows it (else it is looked up).
    """
    if current_lease() is lease:
        set_current_lease(None)
    if heartbeat is None:
        heartbeat = heartbeat_for(task.app, create=False)
    if heartbeat is not None:
        heartbeat.unregister(lease)
    if not lease.stop_serving():
        return False
    lease.count_activity(ended=True)
    announce_the_end(task.app, lease)
    return True


def _lost_on_end(lease: OwnedLease, code: str, what: str) -> NoReturn:
    reason = lease.refused(f"{what} refused: {code}")
    raise LeaseLostError(lease.task_id, lease.token, reason)


def hand_off(task: Any, lease: OwnedLease) -> None:
    """Pass the task id to the replacement ``Task.replace()`` is about to send.

    The lease is deleted, so the replacement (same task id) starts afresh and, if fenced,
    takes a new, higher token. An owner that lost its lease sends no replacement: it gets
    :class:`LeaseLostError` (the body ends as ``Ignore``).
    """
    if not _stop_serving(task, lease):
        raise LeaseLostError(lease.task_id, lease.token, lease.lost_reason or "ended")
    store = task.backend.lease_store
    code = task.backend.retrying(partial(store.hand_off, lease.task_id, lease.owner_id, lease.token))
    # MISSING: gone already (or asked twice): pass it on all the same.
    if code not in (ReleaseOutcome.OK, ReleaseOutcome.MISSING):
        _lost_on_end(lease, code, "hand-off to the replacement")
    logger.info("lease handed off: task %s[%s] token=%s replaced", task.name, lease.task_id, lease.token)


def retry_due(task: Any, lease: OwnedLease, delay: float) -> None:
    """Move the lease to RETRYING *before* ``retry()`` publishes the retry message.

    Celery sends the retry message before it stores RETRY; with a short countdown the
    message can arrive while the lease still says RUNNING and be dropped as a duplicate.
    RETRYING lets it acquire at once; the reaper looks again after its eta plus
    ``fenced_requeue_timeout``.
    """
    if not _stop_serving(task, lease):
        raise LeaseLostError(lease.task_id, lease.token, lease.lost_reason or "ended")
    due_ms = int((delay + ensure_conf(task.app).requeue_timeout) * 1000)
    release_once = partial(
        task.backend.lease_store.release,
        lease.task_id,
        lease.owner_id,
        lease.token,
        status=LeaseStatus.RETRYING,
        due_in_ms=due_ms,
        progress=lease.report(time.monotonic())[0],
    )
    code = task.backend.retrying(release_once)
    if code != ReleaseOutcome.OK:
        _lost_on_end(lease, code, "retry")
    lease.mark_retrying()


def store_rejection(task: Any, request: Any, exc: BaseException) -> None:
    """``Reject(requeue=False)``: store its FAILURE with the token, before the lease ends.

    Celery's main process writes that FAILURE (tokenless) only after the child's postrun;
    stored here through the fence, with Celery's side effects (chord part, chain, errbacks),
    the main process's later write finds the task finished and is dropped, side effects and all.
    Where errors are not stored, the main process's call runs the side effects alone.
    """
    if get_actual_ignore_result(task, request) and not task.store_errors_even_if_ignored:
        return
    task.backend.mark_as_failure(request.id, exc, request=request)


def send_again(task: Any, request: Any) -> None:
    """Send a delivery whose lease could not be acquired (Redis unreachable) again."""
    logger.error("could not acquire the lease of task %s[%s]: sending it again", task.name, request.id)
    task.signature_from_request(request).apply_async(countdown=1)


# -- acquire and release ------------------------------------------------------------------------


def _policy(task: Any) -> TaskPolicy:
    policy: TaskPolicy | None = task.__dict__.get("_fenced_policy")
    if policy is None:
        policy = ensure_conf(task.app).policy_for(task)
        task._fenced_policy = policy
    return policy


def acquire(task: Any, request: Any, attempt: Attempt) -> OwnedLease | None:
    """Take the lease for this delivery, or mark the attempt to be skipped.

    Raises:
        ConfigurationError: the app's result backend is not the fenced one, or the task's
            lease options cannot work.
    """
    store = lease_store_of(task.app, task.name)
    backend = task.backend
    policy = _policy(task)
    owner_id = f"{request.hostname or socket.gethostname()}/{next_attempt_id()}"
    call = recorded_call(task, request)
    started = time.monotonic()
    acquire_once = partial(
        store.acquire,
        request.id,
        owner_id,
        ttl_ms=policy.lease_ttl_ms,
        task_name=task.name,
        max_takeovers=policy.max_takeovers,
        call=call,
        publish_id=str(getattr(request, PUBLISH_ID_HEADER, None) or ""),
    )
    try:
        result = backend.retrying(acquire_once)
    except TypeError:
        logger.warning("the call of task %s is not JSON-serialisable: the reaper cannot re-send it", request.id)
        acquire_once.keywords["call"] = None
        result = backend.retrying(acquire_once)
    if not result.outcome.runs:
        attempt.skip = result.outcome.value
        state = result.state
        logger.info(
            "task %s[%s] not run: %s delivery (lease %s, owner %s, token %s)",
            task.name,
            request.id,
            result.outcome.value,
            state.status,
            state.owner_id,
            state.owner_token,
        )
        return None
    lease = OwnedLease(
        task_id=request.id,
        task_name=task.name,
        owner_id=owner_id,
        token=result.token,
        attempt=result.attempt,
        takeovers=result.takeovers,
        policy=policy,
        call=acquire_once.keywords["call"],
        publish_id=acquire_once.keywords["publish_id"],
        last_progress=started,
        renewed=started,
        started=started,
        checkpoint=result.checkpoint,
        runner=body_runner(),
    )
    attempt.lease = lease
    set_current_lease(lease)
    heartbeat = heartbeat_for(task.app)
    assert heartbeat is not None
    heartbeat.register(lease)
    attempt.heartbeat = heartbeat
    # A takeover is news; a first acquire is every task (Celery already logs it at INFO).
    logger.log(
        logging.INFO if result.previous_status else logging.DEBUG,
        "lease acquired: task %s[%s] token=%s attempt=%s%s",
        task.name,
        request.id,
        lease.token,
        lease.attempt,
        f" (takeover of a {result.previous_status} lease)" if result.previous_status else "",
    )
    if result.previous_status:
        # A takeover is news: Flower learns the new, higher token at once (and from then on
        # ignores the old owner's events), even if the attempt ends before a heartbeat tick.
        # A first attempt is announced by its first renewal: an event per task would cost
        # every short task one more broker publish.
        lease.announce()
        events.send_about(task.app, "task-progress", lease, version=0, takeovers=lease.takeovers)
    fenced_signals.lease_acquired.send(
        sender=task.name,
        task_id=request.id,
        token=lease.token,
        attempt=lease.attempt,
        takeover=bool(result.previous_status),
    )
    return lease


def release(task: Any, request: Any, state: str | None) -> None:
    """End a lease that no result write ended."""
    attempt = attempt_of(request)
    if not isinstance(attempt, Attempt) or attempt.lease is None:
        return
    if not _stop_serving(task, attempt.lease, attempt.heartbeat):
        return
    lease = attempt.lease
    conf = ensure_conf(task.app)
    backend = task.backend
    due_ms = 0
    if state == celery_states.RETRY:
        target = LeaseStatus.RETRYING
        due_ms = int((attempt.retry_delay + conf.requeue_timeout) * 1000)
    elif state == celery_states.REJECTED and attempt.reject_requeue:
        target = LeaseStatus.REQUEUED
        due_ms = int(conf.requeue_timeout * 1000)
    else:
        target = LeaseStatus.DONE
    release_once = partial(
        backend.lease_store.release,
        lease.task_id,
        lease.owner_id,
        lease.token,
        status=target,
        due_in_ms=due_ms,
        keep_ms=backend.expires_ms(celery_states.SUCCESS),
        progress=lease.report(time.monotonic())[0],
    )
    try:
        code = backend.retrying(release_once)
    except Exception:
        logger.exception("could not end the lease of task %s; it will expire", lease.task_id)
        return
    logger.info(
        "lease released: task %s[%s] token=%s -> %s (%s)",
        task.name,
        lease.task_id,
        lease.token,
        target.value,
        code,
    )
