"""The life of an attempt's lease in a worker process: take it, serve it, end it.

* :func:`acquire` takes the lease before the body runs (from ``task_prerun``), so Celery's
  STARTED write already carries the token; a duplicate or finished delivery is marked to be
  skipped.
* The process's :class:`~celery_fenced._worker.heartbeat.Heartbeat` serves every lease it holds;
  :class:`~celery_fenced._worker.listener.WorkerListener` turns what it finds into signals,
  events, reaps and interrupts.
* The body ends it by a result write (see :meth:`~celery_fenced._worker.attempt.Attempt.result_written`),
  or hands it to a replacement (:func:`hand_off`) or a retry (:func:`retry_due`).
* :func:`run_body` runs the body under the lease, and decides what a lost owner's ending is.
* :func:`release` ends a lease that no result write ended (ignored results, ``Ignore``,
  ``Reject``, retries with ignored results); a body that never finished leaves its lease
  LAPSED for a takeover, never DONE (:func:`lapse_unfinished`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NoReturn, TypeVar

from celery import Celery
from celery import states as celery_states
from celery.exceptions import Ignore, Reject
from redis.exceptions import RedisError

from .. import signals as fenced_signals
from .._backend.fence import WriterFence, fence_of, put_fence
from .._celery.compat import get_actual_ignore_result
from .._celery.headers import HANDED_OFF_BY_HEADER, PUBLISH_ID_HEADER
from .._lease.state import LapseOutcome, LeaseStatus, ReleaseOutcome
from .._lease.store import lease_store_of
from .._task.calls import name_callbacks, recorded_call, retry_call
from .._task.owner import OwnedLease
from .._task.running import ATTEMPT_ATTRIBUTE, current_lease, set_current_lease
from .._telemetry import events, tracing
from ..conf import TaskPolicy, ensure_conf, forget_window
from ..exceptions import LeaseInterrupted, LeaseLostError, StaleOwnerError
from .attempt import Attempt, attempt_of, report_the_end, skip
from .heartbeat import Heartbeat, take_back
from .interrupt import body_runner, end_of_body
from .process import WORKER_PROCESS
from .request import cancelled_here
from .runtime import runtime_of, runtimes

__all__ = [
    "SEND_AGAIN_LIMIT",
    "SEND_AGAIN_MAX_DELAY",
    "SENT_AGAIN_HEADER",
    "acquire",
    "again_if_vanished",
    "hand_back",
    "hand_off",
    "heartbeat_for",
    "lapse_unfinished",
    "release",
    "replacement_sent",
    "retry_called",
    "retry_due",
    "run_body",
    "send_again",
    "still_owner",
    "stop_heartbeats",
    "store_late_result",
    "store_rejection",
    "times_sent_again",
]

logger = logging.getLogger("celery_fenced.worker.lifecycle")

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


def run_body(task: Any, request: Any, call_body: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Run the body of ``task``'s attempt of ``request`` (``ProgressLeasedTask.__call__`` in a
    worker, for a request whose attempt began).

    ``call_body`` is Celery's ``Task.__call__`` (a body that runs without a lease). A lost
    owner stores nothing (its ending is ``Ignore``), unless nobody took over and its late
    result can still land through the fence.
    """
    attempt: Attempt = getattr(request, ATTEMPT_ATTRIBUTE)  # attempt_of(), inlined: every task's path
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
        attempt.rejected(bool(exc.requeue))
        if not exc.requeue and lease.lost_reason is None and not lease.ended:
            store_rejection(task, request, exc)
        raise
    except Exception as exc:
        if cancelled_here(request.id):
            # Celery cancelled the request (a cold shutdown) and the pool could not stop the
            # body: what its cancel raised into the body (solo) is not the task's end.
            if _stop_serving(task, lease, attempt.heartbeat):
                lapse_unfinished(task, lease)
            raise Ignore() from exc
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
    # Celery sends callbacks and the next chain step *before* it stores the result, so the
    # store's fence alone cannot stop a zombie's chain: check now. A pause right after the
    # check still lets a zombie send them late: each is sent as a publish of this run
    # (tag_publish), under the same id by every owner of it, so a late copy of a fenced one
    # does not run again.
    sends = request.callbacks or request.chain or request.chord
    if lease.lost_reason is None and sends and still_owner(task, lease):
        name_callbacks(request.callbacks, lease.task_id, lease.publish_id)
    if lease.lost_reason is not None and not store_late_result(task, attempt, request, retval):
        # A stale owner ends as Ignore: nothing stored, nothing sent, and no task-succeeded
        # event that would show the task on the zombie's worker again.
        raise Ignore()
    return retval


def _describe_on_span(task: Any, request: Any, lease: OwnedLease) -> None:
    """Put the attempt on its ``run/<task>`` span (where OpenTelemetry records one), and keep
    the span's context on the lease, for the links of a takeover."""
    span = tracing.attempt_began(
        request, token=lease.token, attempt=lease.attempt, takeovers=lease.takeovers, stage=lease.stage
    )
    if span is None:
        return
    lease.body.traced(span, partial(tracing.stage_changed, span))
    traceparent = tracing.traceparent_of(span)
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
    if lease.lost_reason is None and (current is None or current[1] < lease.token):
        # Its lease is gone (or an older token's stands in its place): the store lost data.
        # The owner goes on only once it has its lease back (a thawed owner never does).
        try:
            if take_back(task.backend.lease_store, lease, "chain and callbacks"):
                return True
        except RedisError as exc:
            logger.warning("could not restore the lease of task %s: %r", lease.task_id, exc)
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
        fence = fence_of(request)
        if fence is not None:
            put_fence(request, fence.result_written())  # the trace's own write of it is skipped
        return True
    return False


def _stop_serving(task: Any, lease: OwnedLease, heartbeat: Heartbeat | None = None) -> bool:
    """The attempt ends its lease itself: no more renewals; False if it already ended or was lost.

    ``heartbeat`` is the one serving it, when the caller knows it (else it is looked up).
    """
    if heartbeat is None:
        heartbeat = heartbeat_for(task.app, create=False)
    if heartbeat is not None:
        heartbeat.unregister(lease)
    activity = lease.stop_serving()
    if activity is None:
        return False
    report_the_end(task.app, lease, activity)
    return True


def _lost_on_end(lease: OwnedLease, code: str, what: str) -> NoReturn:
    reason = lease.refused(f"{what} refused: {code}")
    raise LeaseLostError(lease.task_id, lease.token, reason)


def hand_off(task: Any, lease: OwnedLease, replacement: Any = None) -> None:
    """Pass the task id to the replacement ``Task.replace()`` is about to send.

    Fenced like a write: only the current owner hands off. The lease becomes a HANDED_OFF
    record that only the replacement's message (it names this owner's token:
    :func:`~celery_fenced._task.calls.mark_replacement`) can start; a later copy of the replaced
    message does not run. An owner that lost its lease, or whose lease is gone, sends no
    replacement: it gets :class:`LeaseLostError` (the body ends as ``Ignore``).

    ``replacement`` (its signature, every id frozen and every publish named after this run:
    :func:`~celery_fenced._task.calls.mark_replacement`) is kept with the record: should the
    owner be lost before it says it sent it, or should it not start within the requeue timeout
    once said sent (the broker lost it), the reaper sends it again, the same message, instead
    of running this body again (a canvas step with an id of its own would run twice).
    """
    if not _stop_serving(task, lease):
        raise LeaseLostError(lease.task_id, lease.token, lease.lost_reason or "ended")
    store = task.backend.lease_store
    # The record lives as long as the replacement's result, and at least as long as a copy of
    # the replaced message can still arrive (the forget window), however short result_expires.
    keep_ms = task.backend.expires_ms(celery_states.SUCCESS)
    if keep_ms:
        keep_ms = max(keep_ms, int(forget_window(task.app) * 1000))
    # Filed under this start of the worker until the owner says it sent the replacement: a
    # whole worker lost in between (its liveness record lapses) is taken over.
    try:
        recorded = json.dumps(replacement) if replacement is not None else ""
    except (TypeError, ValueError):
        recorded = ""  # not JSON (a pickled argument): an owner lost before it says it sent is taken over
    hand = partial(
        store.hand_off,
        lease.task_id,
        lease.owner_id,
        lease.token,
        keep_ms=keep_ms,
        worker_id=WORKER_PROCESS.worker_id,
        replacement=recorded,
    )
    code = again_if_vanished(store, lease, hand(), hand, "hand-off")
    if code != ReleaseOutcome.OK:
        _lost_on_end(lease, code, "hand-off to the replacement")
    logger.info("lease handed off: task %s[%s] token=%s replaced", task.name, lease.task_id, lease.token)


#: What an owner's end of its lease answers (:func:`again_if_vanished`).
_End = TypeVar("_End", ReleaseOutcome, LapseOutcome)


def again_if_vanished(store: Any, lease: OwnedLease, code: _End, again: Callable[[], _End], before: str) -> _End:
    """An owner's end of its lease (``code``, what its script answered: a hand-off, a retry's
    RETRYING, a release, a lapse) found the lease gone (``MISSING``: an eviction, a FLUSH, a
    restart without persistence, a failover that lost writes). A missing lease is never a
    successful end, as a newer owner's may have vanished with it; nor may the owner just go on
    without it: nothing would be left in Redis to run the task (a retry never sent, a body that
    never finished never taken over). Written back as the heartbeat writes a vanished lease
    back (:func:`take_back`): while the owner's last renewal is less than a TTL ago nobody else
    can hold the task, and the end is made ``again``; else the lease is given up for the reaper
    to re-send the task, and the answer stays ``MISSING`` (nothing is sent)."""
    if code in (ReleaseOutcome.MISSING, LapseOutcome.MISSING) and take_back(store, lease, before):
        return again()
    return code


def replacement_sent(task: Any, lease: OwnedLease) -> None:
    """``Task.replace()`` sent the replacement: the hand-off's record waits for it.

    A record that keeps its replacement (:func:`hand_off`) is due after the requeue timeout:
    should the replacement not start by then (the broker lost its message), the reaper sends
    it again, the same message under the same ids, so a copy of one that was only late does
    not run.

    Never raises: the replacement is on its way whatever Redis answers. Unsaid (Redis could
    not be reached), the record stays filed under the worker: should the whole worker be lost
    before the replacement starts, the task is taken over, and the replacement, when it comes,
    is a copy that does not run.
    """
    try:
        code = task.backend.lease_store.replacement_sent(
            lease.task_id,
            lease.owner_id,
            lease.token,
            worker_id=WORKER_PROCESS.worker_id,
            due_in_ms=int(ensure_conf(task.app).requeue_timeout * 1000),
        )
    except Exception as exc:
        logger.warning(
            "task %s[%s] token=%s: its replacement was sent, and saying so failed (%r): should this worker "
            "be lost before the replacement starts, the task is taken over",
            task.name,
            lease.task_id,
            lease.token,
            exc,
        )
        return
    if code != ReleaseOutcome.OK:
        logger.info("task %s[%s] token=%s: replacement sent, hand-off %s", task.name, lease.task_id, lease.token, code)


def hand_back(task: Any, lease: OwnedLease, error: BaseException) -> None:
    """The replacement could not be sent: the owner takes its lease back.

    ``Task.replace()`` raises the send's error out of the body: Celery stores it as the task's
    FAILURE, through the fence, with the owner's token. The hand-off's record would refuse
    that write (its token handed off) and no replacement would ever start: the task would
    never end. Taken back, the lease is the owner's again until that write ends it.
    """
    store = task.backend.lease_store
    code = store.hand_back(
        lease.task_id, lease.owner_id, lease.token, ttl_ms=lease.policy.lease_ttl_ms, worker_id=WORKER_PROCESS.worker_id
    )
    if code != ReleaseOutcome.OK:
        logger.warning(
            "hand-off of task %s[%s] token=%s not taken back (%s) after its replacement's send failed: %r",
            task.name,
            lease.task_id,
            lease.token,
            code,
            error,
        )
        return
    logger.warning(
        "hand-off of task %s[%s] token=%s taken back: its replacement could not be sent: %r",
        task.name,
        lease.task_id,
        lease.token,
        error,
    )


def retry_called(
    task: Any,
    request: Any,
    delay: float,
    max_retries: int | None,
    args: Any = None,
    kwargs: Any = None,
    options: Mapping[str, Any] | None = None,
) -> None:
    """``retry()`` was called in the attempt of ``request`` (``ProgressLeasedTask.retry``).

    Its writes carry ``delay`` from now on (the RETRY write's lease waits that long for the
    message). Where Celery will send the retry message (``max_retries`` allows it), the lease
    is moved to RETRYING first: :func:`retry_due`.
    """
    attempt = attempt_of(request)
    if attempt is None:
        return
    fence = fence_of(request)
    if fence is not None and not fence.skipped:
        put_fence(request, fence.retried(delay))
    lease = attempt.lease
    if (
        lease is not None
        and not request.called_directly
        and (max_retries is None or request.retries + 1 <= max_retries)
    ):
        call = retry_call(lease.call, request.retries + 1, args, kwargs, options or {})
        retry_due(task, lease, delay, call)


def retry_due(task: Any, lease: OwnedLease, delay: float, call: Mapping[str, Any] | None = None) -> None:
    """Move the lease to RETRYING *before* ``retry()`` publishes the retry message.

    Celery sends the retry message before it stores RETRY; with a short countdown the
    message can arrive while the lease still says RUNNING and be dropped as a duplicate.
    RETRYING lets it acquire at once; the reaper looks again after its eta plus
    ``fenced_requeue_timeout``, and then sends ``call``, the retry's own (its arguments and
    ``retries``), recorded in place of this run's: the run that retried is done.
    """
    if not _stop_serving(task, lease):
        raise LeaseLostError(lease.task_id, lease.token, lease.lost_reason or "ended")
    due_ms = int((delay + ensure_conf(task.app).requeue_timeout) * 1000)
    store = task.backend.lease_store
    retrying = partial(
        store.release,
        lease.task_id,
        lease.owner_id,
        lease.token,
        status=LeaseStatus.RETRYING,
        due_in_ms=due_ms,
        progress=lease.report(time.monotonic())[0],
        call=call,
    )
    code = again_if_vanished(store, lease, retrying(), retrying, "retry")
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


#: The message header counting how many times in a row a task was sent again because its
#: lease could not be acquired (:func:`send_again`).
SENT_AGAIN_HEADER = "fenced_sent_again"

#: How many times in a row a task is sent again because its lease could not be acquired;
#: the delivery after that ends as a FAILURE (``LeaseUnavailableError``). With the delays
#: below, about a minute and a half: a failover, a restart, a Redis that comes back.
SEND_AGAIN_LIMIT = 12

#: The longest wait before a task is sent again, seconds (1, 2, 4, 8, then this).
SEND_AGAIN_MAX_DELAY = 10


def times_sent_again(request: Any) -> int:
    """How many times in a row this delivery's task was sent again by :func:`send_again`."""
    try:
        return max(0, int(getattr(request, SENT_AGAIN_HEADER, None) or 0))
    except (TypeError, ValueError):
        return 0


def send_again(task: Any, request: Any) -> None:
    """Send a delivery whose lease could not be acquired (Redis unreachable, or refusing) again,
    counting the times in its header; once :data:`SEND_AGAIN_LIMIT` is reached the next
    delivery that cannot acquire ends as a FAILURE instead (``hooks.on_task_prerun``)."""
    sent = times_sent_again(request)
    delay = min(2**sent, SEND_AGAIN_MAX_DELAY)
    logger.error(
        "could not acquire the lease of task %s[%s]: sending it again in %d s (%d of %d)",
        task.name,
        request.id,
        delay,
        sent + 1,
        SEND_AGAIN_LIMIT,
    )
    signature = task.signature_from_request(request)
    headers = dict(signature.options.get("headers") or {})
    headers[SENT_AGAIN_HEADER] = sent + 1
    signature.apply_async(countdown=delay, headers=headers)


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
    policy = _policy(task)
    owner_id = f"{request.hostname or socket.gethostname()}/{WORKER_PROCESS.attempt_ids.next_id()}"
    call = recorded_call(task, request)
    hostname = request.hostname or socket.gethostname()
    # task_track_started: the STARTED Celery's trace writes next is stored by the acquire, in
    # the same call (the trace's own write of it is then skipped: WriterFence.started_stored).
    tracked = task.track_started and not get_actual_ignore_result(task, request)
    started_head = task.backend.started_head(request.id, request, hostname) if tracked else ""
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
        handed_off_by=str(getattr(request, HANDED_OFF_BY_HEADER, None) or ""),
        started_head=started_head,
        started_expires_ms=task.backend.expires_ms(celery_states.STARTED) if started_head else 0,
    )
    try:
        result = acquire_once()
    except TypeError:
        logger.warning("the call of task %s is not JSON-serialisable: the reaper cannot re-send it", request.id)
        acquire_once.keywords["call"] = None
        result = acquire_once()
    if not result.outcome.runs:
        skip(request, attempt, result.outcome.value)
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
        handed_off_by=acquire_once.keywords["handed_off_by"],
        started=started,
        checkpoint=result.checkpoint,
        runner=body_runner(),
    )
    # What its writes carry: fence_for(lease), inlined (every task's path).
    put_fence(
        request,
        WriterFence(
            lease.task_id,
            lease.token,
            owner_id,
            lease.publish_id,
            lease.attempt,
            lease.takeovers,
            started_stored=bool(started_head),
        ),
    )
    heartbeat = heartbeat_for(task.app)
    assert heartbeat is not None
    attempt.hold(lease, heartbeat)
    set_current_lease(lease)
    heartbeat.register(lease)
    # A takeover or a retry is news; a first acquire is every task (Celery already logs it at INFO).
    logger.log(
        logging.INFO if result.previous_status else logging.DEBUG,
        "lease acquired: task %s[%s] token=%s attempt=%s%s",
        task.name,
        request.id,
        lease.token,
        lease.attempt,
        _what_came_before(result.previous_status, request),
    )
    retry = result.previous_status == LeaseStatus.RETRYING
    if result.previous_status:
        # A takeover is news: Flower learns the new, higher token at once (and from then on
        # ignores the old owner's events), even if the attempt ends before a heartbeat tick.
        # A first attempt is announced by its first renewal: an event per task would cost
        # every short task one more broker publish. A retry says so, and which one it is.
        lease.announce()
        said = _retry_said(request) if retry else {}
        events.send_about(task.app, "task-progress", lease, version=0, takeovers=lease.takeovers, **said)
    fenced_signals.lease_acquired.send(
        sender=task.name,
        task_id=request.id,
        token=lease.token,
        attempt=lease.attempt,
        takeover=bool(result.previous_status) and not retry,  # a retry is not a takeover (§4.9)
        retry=retry,
    )
    return lease


def _what_came_before(previous_status: str, request: Any) -> str:
    """The end of the "lease acquired" line: a retry is called a retry (its earlier attempt
    asked for it: ``self.retry()``, ``autoretry_for``), a takeover a takeover."""
    if not previous_status:
        return ""
    if previous_status == LeaseStatus.RETRYING:
        return f" ({_retry_words(request)})"
    return f" (takeover of a {previous_status} lease)"


def _retry_words(request: Any) -> str:
    return f"retry {getattr(request, 'retries', None) or '?'} of the task, not a takeover"


def _retry_said(request: Any) -> dict[str, Any]:
    """What the acquire's event of a retried run adds: Flower shows the attempt as a retry."""
    return {"cause": events.RETRY_CAUSE, "retries": getattr(request, "retries", None), "reason": _retry_words(request)}


def release(task: Any, request: Any, state: str | None) -> None:
    """End a lease that no result write ended.

    ``state`` is the one Celery's ``task_postrun`` gives: ``None`` when the body never
    finished (a ``BaseException`` escaped it: a cold shutdown or a revoke stopped it, a hard
    time limit on the gevent pool, a ``SystemExit`` or ``KeyboardInterrupt``). Such a lease
    is never DONE: it lapses now, for a takeover (:func:`lapse_unfinished`).
    """
    attempt = attempt_of(request)
    if attempt is None or attempt.lease is None:
        return
    if current_lease() is attempt.lease:
        set_current_lease(None)  # the body's API holds it until here, after a hand-off or retry too
    if not _stop_serving(task, attempt.lease, attempt.heartbeat):
        return
    lease = attempt.lease
    if state is None:
        lapse_unfinished(task, lease)
        return
    conf = ensure_conf(task.app)
    backend = task.backend
    due_ms = 0
    if state == celery_states.RETRY:
        target = LeaseStatus.RETRYING
        fence = fence_of(request)
        retry_delay = fence.retry_delay if fence is not None else 0.0
        due_ms = int((retry_delay + conf.requeue_timeout) * 1000)
    elif state == celery_states.REJECTED and attempt.reject_requeue:
        target = LeaseStatus.REQUEUED
        due_ms = int(conf.requeue_timeout * 1000)
    else:
        target = LeaseStatus.DONE
    end = partial(
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
        code = again_if_vanished(backend.lease_store, lease, end(), end, f"end ({target.value})")
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


def lapse_unfinished(task: Any, lease: OwnedLease) -> None:
    """Give up the lease of a body that never finished: LAPSED now, due for a takeover.

    The task finishes on another worker (or on this one, once the reaper sends it again),
    from the owner's last checkpoint. A READY state that the worker's main process writes
    for this attempt next, without a token (a hard time limit's FAILURE, a revoke's
    REVOKED), is still stored, as Celery stores it, while no newer owner took the task.
    """
    store = task.backend.lease_store
    give_up = partial(
        store.lapse,
        lease.task_id,
        lease.owner_id,
        lease.token,
        mode="unfinished",
        progress=lease.report(time.monotonic())[0],
    )
    try:
        code = again_if_vanished(store, lease, give_up(), give_up, "takeover (its body did not finish)")
    except Exception:
        logger.exception("could not give up the lease of task %s; it will expire", lease.task_id)
        return
    logger.log(
        logging.WARNING if code == LapseOutcome.OK else logging.INFO,
        "lease given up: task %s[%s] token=%s: its body did not finish; LAPSED for a takeover (%s)",
        task.name,
        lease.task_id,
        lease.token,
        code,
    )
