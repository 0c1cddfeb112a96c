"""The lease store: every change to the shared lease state in Redis, one script each.

The values it reads and answers (:class:`~celery_fenced._lease.state.LeaseState` and the outcome
types) live in :mod:`celery_fenced._lease.state`.

:class:`LeaseStore` runs the scripts of :mod:`celery_fenced._lease.scripts` through
:mod:`celery_fenced._lease.gateway`, one atomic script per change of ownership or status, and maps
their return codes to named outcomes.
Public methods check their arguments; the Redis work sits in the small private methods.
Times in the shared state are milliseconds of the Redis server's clock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kombu.utils import json
from redis.exceptions import ConnectionError, TimeoutError

from ..exceptions import ConfigurationError
from .finished import fence_of
from .gateway import NO_RETRY, Retry, ScriptSet
from .keys import KeySpace
from .liveness_store import LivenessStore
from .metrics_store import MetricsStore
from .state import (
    AcquireOutcome,
    AcquireResult,
    CancelOutcome,
    CancelResult,
    Checkpoint,
    ClaimOutcome,
    ClaimResult,
    ForgetOutcome,
    LapseNowOutcome,
    LapseOutcome,
    LeaseState,
    LeaseStatus,
    ProgressReport,
    RedriveOutcome,
    ReleaseOutcome,
    RenewOutcome,
    RenewRequest,
    Reservation,
    ReserveOutcome,
    RestoreOutcome,
    StoreOutcome,
    StoreResult,
    as_text,
    outcome,
)
from .tokens import TokenCounter

__all__ = [
    "LeaseStore",
    "is_fenced",
    "lease_store_of",
    "outcome",
]

logger = logging.getLogger("celery_fenced.store")

#: kombu's JSON (datetimes, UUIDs, Decimals and bytes survive the round trip, as in Celery's
#: own messages); one encoder for every call (it keeps no state between calls).
_CALL_ENCODER = json.JSONEncoder()

#: No progress to publish (a version of 0 is never newer than the stored one).
_NO_PROGRESS = ProgressReport()

#: What ``store.lua`` answers with 1.
_STORED_DONE = StoreResult(StoreOutcome.STORED, "DONE")


def _require_task_id(task_id: Any) -> str:
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f"task_id must be a non-empty string, got {task_id!r}")
    return task_id


def _require_token(token: Any) -> int:
    if isinstance(token, bool) or not isinstance(token, int) or token <= 0:
        raise ValueError(f"a fencing token must be a positive int, got {token!r}")
    return token


class LeaseStore:
    """Runs the lease scripts against one Redis client.

    The calls of a task's path (reserve, acquire, hand-off, release, a body's lapse, the
    result write) run again under ``retry`` after a connection error; the scripts of
    ownership answer a call made again after a lost reply as they answered the first. The
    heartbeat's and the reaper's calls run once: their next tick or pass tries again.

    Args:
        client: a redis-py client (the result backend's own client).
        keys: the key space (prefix and Celery's result-key prefix).
        retry: the retry policy of a task's path (the fenced backend's: Celery's retry loop);
            by default a call runs once.
    """

    def __init__(self, client: Any, keys: KeySpace, *, retry: Retry = NO_RETRY) -> None:
        self.client = client
        self.keys = keys
        self.retry = retry
        self.scripts = ScriptSet(client)
        self.tokens = TokenCounter(client, self.scripts, keys)
        #: The workers' liveness records, on the same client and scripts.
        self.liveness = LivenessStore(client, self.scripts, keys)
        #: The cluster's metrics, on the same client and scripts.
        self.metrics = MetricsStore(client, self.scripts, keys)

    def close(self) -> None:
        """Close the connections the scripts keep (not the client's, which is its owner's)."""
        self.scripts.close()

    # -- the receiving worker's side ------------------------------------------------------

    def reserve_many(
        self, reservations: Sequence[Reservation], reserved_by: str, worker_id: str | None = None
    ) -> list[ReserveOutcome]:
        """Record the reservations of messages one worker received, in one round trip.

        Only where no live lease exists: a missing lease, a reservation or a re-sent task's
        becomes ``RESERVED`` by ``reserved_by`` (the worker's hostname); any other is left
        alone. ``worker_id`` (:func:`~celery_fenced._lease.liveness_store.worker_id_of`; the hostname
        when not given) names the start of the worker whose liveness record answers for them.
        """
        if not reservations:
            return []
        keys = [self.keys.index, self.keys.reserved_by(worker_id or reserved_by)]
        args: list[Any] = [reserved_by]
        for item in reservations:
            keys += [self.keys.lease(_require_task_id(item.task_id)), self.keys.result(item.task_id)]
            call_json = _CALL_ENCODER.encode(item.call) if item.call else ""
            args += [max(0, int(item.expires_in_ms)), item.task_name, call_json, item.max_takeovers, item.publish_id]
            args.append(item.handed_off_by)
        codes = self.retry(self.scripts.reserve, keys, args)
        return [outcome(ReserveOutcome, "reserve", code) for code in codes]

    def lapse_reserved(self, task_ids: Iterable[str], reserved_by: str, worker_id: str | None = None) -> int:
        """Make the reservations ``reserved_by`` still holds for ``task_ids`` due now; how many.

        Each leaves the reservations of ``worker_id`` (the hostname when not given): the worker
        holds none of them any more.
        """
        leases = [self.keys.lease(_require_task_id(task_id)) for task_id in task_ids]
        if not leases:
            return 0
        keys = [self.keys.index, self.keys.reserved_by(worker_id or reserved_by), *leases]
        return int(self.retry(self.scripts.lapse_reserved, keys, [reserved_by]))

    def unreserve(self, task_ids: Iterable[str], worker_id: str) -> int:
        """The requests of ``task_ids`` that ``worker_id`` (one start of a worker) reserved ended
        there: their entries leave its reservations (``unreserve.lua``). How many did."""
        leases = [self.keys.lease(_require_task_id(task_id)) for task_id in task_ids]
        if not leases:
            return 0
        return int(self.retry(self.scripts.unreserve, [self.keys.reserved_by(worker_id)], leases))

    # -- owner side ---------------------------------------------------------------------

    def acquire(
        self,
        task_id: str,
        owner_id: str,
        *,
        ttl_ms: int,
        task_name: str,
        max_takeovers: int,
        call: Mapping[str, Any] | None = None,
        stage: str = "",
        publish_id: str = "",
        handed_off_by: str = "",
        started_head: str = "",
        started_expires_ms: int = 0,
    ) -> AcquireResult:
        """Take the lease of ``task_id`` for one execution, following the status table.

        ``publish_id`` names the ``apply_async`` whose message this is: a DONE lease runs a
        delivery of another publish again (Celery lets a task id be applied again).
        ``handed_off_by`` is the token the message says the task id was handed off from (a
        replacement's): after a hand-off only the message naming it runs.
        ``started_head`` (``task_track_started``) is the run's STARTED meta, JSON without its
        closing brace: a run that takes the lease stores it as its result, with its token as
        ``fence_token``, kept ``started_expires_ms`` (0: for ever), in the same call.
        """
        _require_task_id(task_id)
        if not owner_id:
            raise ValueError("owner_id must not be empty")
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be positive, got {ttl_ms!r}")
        call_json = _CALL_ENCODER.encode(call) if call else ""
        reply = self.retry(
            self._acquire,
            task_id,
            owner_id,
            ttl_ms,
            task_name,
            call_json,
            max_takeovers,
            stage,
            publish_id,
            handed_off_by,
            started_head,
            started_expires_ms,
        )
        if isinstance(reply, int):  # a first delivery: its token alone
            return AcquireResult.first(task_id, reply)
        code, previous, flat, *rest = reply
        answer = outcome(AcquireOutcome, "acquire", code)
        checkpoint = Checkpoint.from_json(as_text(rest[0])) if rest else None
        return AcquireResult.from_reply(task_id, answer, as_text(previous), flat, checkpoint)

    def _acquire(
        self,
        task_id: str,
        owner_id: str,
        ttl_ms: int,
        task_name: str,
        call_json: str,
        max_takeovers: int,
        stage: str,
        publish_id: str,
        handed_off_by: str,
        started_head: str = "",
        started_expires_ms: int = 0,
    ) -> Any:
        keys = [
            self.keys.lease(task_id),
            self.keys.token,
            self.keys.index,
            self.keys.token_epoch,
            self.keys.result(task_id),
        ]
        args: list[Any] = [owner_id, ttl_ms, task_name, call_json, max_takeovers, stage, publish_id]
        if handed_off_by or started_head:
            args.append(handed_off_by)  # left out otherwise: each argument costs the server
        if started_head:
            args += [started_head, max(0, int(started_expires_ms))]
        return self.tokens.hand_out(lambda: self.scripts.acquire(keys=keys, args=args))

    def renew_many(self, requests: Sequence[RenewRequest]) -> list[RenewOutcome]:
        """Renew many leases of one process in one round trip, publishing their progress; one
        code per request."""
        if not requests:
            return []
        keys = [self.keys.index]
        args: list[Any] = []
        for req in requests:
            _require_token(req.token)
            keys.append(self.keys.lease(req.task_id))
            progress = req.progress
            args += [req.owner_id, req.token, req.ttl_ms, progress.stage, progress.version, max(0, progress.age_ms)]
            args += ["STALLED" if req.stalled else "RUNNING", progress.details]
        codes = self.scripts.renew(keys=keys, args=args)
        return [outcome(RenewOutcome, "renew", code) for code in codes]

    def lapse(
        self, task_id: str, owner_id: str, token: int, *, mode: str, progress: ProgressReport = _NO_PROGRESS
    ) -> LapseOutcome:
        """Report a stall: ``mode`` ``"release"`` gives the lease up now, ``"expire"`` lets it run out;
        or, ``mode`` ``"unfinished"``, a body that stopped without finishing: the lease is given
        up now, for a takeover (cause ``gone``), with no stall recorded.

        ``progress`` (the owner's last) is published first, for the next owner's checkpoint.
        """
        if mode not in ("release", "expire", "unfinished"):
            raise ValueError(f"mode must be 'release', 'expire' or 'unfinished', got {mode!r}")
        keys = [self.keys.lease(_require_task_id(task_id)), self.keys.index]
        args: list[Any] = [owner_id, _require_token(token), mode, *progress.script_args()]
        if mode == "unfinished":  # the body's last word: no later tick sends it again
            answer = self.retry(self.scripts.lapse, keys, args)
        else:  # a stall, reported by the heartbeat: its next tick tries again
            answer = self.scripts.lapse(keys=keys, args=args)
        return outcome(LapseOutcome, "lapse", answer[0])

    def release(
        self,
        task_id: str,
        owner_id: str,
        token: int,
        *,
        status: LeaseStatus,
        due_in_ms: int = 0,
        keep_ms: int = 0,
        progress: ProgressReport = _NO_PROGRESS,
        call: Mapping[str, Any] | None = None,
    ) -> ReleaseOutcome:
        """End an attempt without a READY result: DONE, RETRYING or REQUEUED.

        ``progress`` (the owner's last) is published first: a retry's checkpoint. ``call``
        (RETRYING only) is the retry's own call, recorded for the reaper in place of the
        retried run's.
        """
        if status not in (LeaseStatus.DONE, LeaseStatus.RETRYING, LeaseStatus.REQUEUED):
            raise ValueError(f"release takes DONE, RETRYING or REQUEUED, not {status!r}")
        keys = [self.keys.lease(_require_task_id(task_id)), self.keys.index]
        args: list[Any] = [owner_id, _require_token(token), status.value, max(0, due_in_ms), max(0, keep_ms)]
        args += progress.script_args()
        if call and status == LeaseStatus.RETRYING:
            args.append(_CALL_ENCODER.encode(call))
        return outcome(ReleaseOutcome, "release", self.retry(self.scripts.release, keys, args)[0])

    def restore(
        self,
        task_id: str,
        owner_id: str,
        token: int,
        *,
        ttl_ms: int,
        task_name: str,
        call: Mapping[str, Any] | None,
        attempt: int,
        takeovers: int,
        max_takeovers: int,
        renewal_age_ms: int,
        stage: str = "",
        lapsed: bool = False,
        publish_id: str = "",
        handed_off_by: str = "",
    ) -> RestoreOutcome:
        """Put back the lease of a live owner after its hash vanished.

        ``publish_id`` and ``handed_off_by`` are the run's, as its acquire had them (the
        hand-off that started a replacement's run), written back with it.

        ``renewal_age_ms`` is how long ago, by the owner's clock, it sent its last accepted
        renewal: a lease that could have expired (a TTL or more) is not put back. With
        ``lapsed`` it is written back given up (LAPSED, due now), for the reaper to re-send,
        whatever that age.

        Returns ``"restored"``; or, writing nothing, ``"exists"`` (another delivery acquired
        it meanwhile), ``"finished"`` (the task finished under this token: its lease lives
        on in the result), ``"stale-token"`` (it finished under another token) or
        ``"expired"`` (the owner's lease could have expired).
        """
        keys = [self.keys.lease(_require_task_id(task_id)), self.keys.token, self.keys.index, self.keys.result(task_id)]
        call_json = _CALL_ENCODER.encode(call) if call else ""
        args: list[Any] = [owner_id, _require_token(token), ttl_ms, task_name, call_json, attempt, takeovers]
        args += [max_takeovers, stage, max(0, int(renewal_age_ms)), "lapsed" if lapsed else "", publish_id]
        args.append(handed_off_by)
        return outcome(RestoreOutcome, "restore", self.scripts.restore(keys=keys, args=args)[0])

    def hand_off(
        self,
        task_id: str,
        owner_id: str,
        token: int,
        *,
        keep_ms: int = 0,
        worker_id: str | None = None,
        replacement: str = "",
    ) -> ReleaseOutcome:
        """Pass the task id to a replacement (``Task.replace()``), fenced like a write.

        The lease becomes a ``HANDED_OFF`` record, kept ``keep_ms`` (0: for ever) or until
        the replacement starts: only a message naming ``token`` as the one it was handed off
        from runs the task id then (see :data:`~celery_fenced._celery.headers.HANDED_OFF_BY_HEADER`).
        With ``worker_id`` (the owner's worker, one start of it), the record is filed among
        that worker's reservations until :meth:`replacement_sent`: should the worker's liveness
        record lapse first, the task is taken over (the replacement may never have been sent).

        ``replacement`` (JSON of the replacement's signature, as it is about to be sent; ``""``
        when it cannot be recorded) is kept with the record: should the owner be lost before it
        says it sent it, or should it not start within the requeue timeout once said sent, the
        reaper sends it again rather than running the replaced body again.

        Returns ``"ok"`` (the caller sends the replacement), or why the owner no longer holds
        it (``"stale-token"``, ``"not-owner"``, ``"finished"``, ``"missing"``): then nothing
        may be sent.
        """
        keys = [self.keys.lease(_require_task_id(task_id)), self.keys.index]
        if worker_id:
            keys.append(self.keys.reserved_by(worker_id))
        args: list[Any] = [owner_id, _require_token(token), "HANDOFF", worker_id or "", max(0, keep_ms)]
        if replacement:
            args += ["", "", "", "", replacement]
        return outcome(ReleaseOutcome, "release", self.retry(self.scripts.release, keys, args)[0])

    def replacement_sent(
        self,
        task_id: str,
        owner_id: str,
        token: int,
        *,
        worker_id: str | None = None,
        due_in_ms: int | None = None,
    ) -> ReleaseOutcome:
        """Say that the owner which handed off with ``token`` sent its replacement
        (``replacement_sent.lua``; run again under ``retry``): its record waits for the
        replacement whatever becomes of the owner, and leaves ``worker_id``'s reservations.

        With ``due_in_ms`` (the requeue timeout), a record that keeps its replacement (see
        :meth:`hand_off`) is due then: a replacement not started by then (the broker lost
        it) is sent again by the reaper.

        Returns ``"ok"``, or why no hand-off of this owner waits (``"finished"``: the
        replacement started, or the reaper undid the hand-off; ``"stale-token"``,
        ``"not-owner"``, ``"missing"``).
        """
        keys = [self.keys.lease(_require_task_id(task_id)), self.keys.index]
        args: list[Any] = [owner_id, _require_token(token), worker_id or ""]
        if worker_id:
            keys.append(self.keys.reserved_by(worker_id))
        if due_in_ms is not None:
            args.append(max(0, int(due_in_ms)))
        return outcome(ReleaseOutcome, "replacement_sent", self.retry(self.scripts.replacement_sent, keys, args)[0])

    def hand_back(
        self, task_id: str, owner_id: str, token: int, *, ttl_ms: int, worker_id: str | None = None
    ) -> ReleaseOutcome:
        """Take back a hand-off whose replacement could not be sent (``hand_back.lua``; run
        again under ``retry``).

        Only the owner's own ``HANDED_OFF`` record, before anything started the task id
        since: the lease is the owner's again, ``RUNNING`` for ``ttl_ms``, so its error is
        stored through the fence; its filing leaves ``worker_id``'s reservations. Returns
        ``"ok"``, or why there is nothing to take back.
        """
        keys = [self.keys.lease(_require_task_id(task_id)), self.keys.index]
        if worker_id:
            keys.append(self.keys.reserved_by(worker_id))
        args: list[Any] = [owner_id, _require_token(token), max(1, int(ttl_ms))]
        return outcome(ReleaseOutcome, "hand_back", self.retry(self.scripts.hand_back, keys, args)[0])

    def store(
        self,
        task_id: str,
        token: int | None,
        meta: bytes | str,
        *,
        state: str,
        kind: str,
        expires_ms: int,
        retry_due_ms: int = 0,
        writer: str = "",
        worker_lost: bool = False,
        owner_id: str = "",
        handed_off_by: str = "",
        put_back: bool = False,
    ) -> StoreResult:
        """Write a result through the fence (see store.lua for every outcome).

        ``handed_off_by`` (tokenless writes): the token the writer's message says the task id
        was handed off from. ``put_back`` (tokenless READY writes): Celery puts the message
        back after this write, to run the task again; the lease is left REQUEUED for it.
        """
        if kind not in ("ready", "retry", "other"):
            raise ValueError(f"kind must be 'ready', 'retry' or 'other', got {kind!r}")
        keys = [
            self.keys.lease(_require_task_id(task_id)),
            self.keys.result(task_id),
            self.keys.index,
        ]
        written_by = "" if token is None else _require_token(token)
        args: list[Any] = [written_by, meta, state, kind, max(0, expires_ms), owner_id]
        # The arguments past the last one the write needs are left out (see store.lua).
        if token is None:
            args += [max(0, retry_due_ms), writer, "1" if worker_lost else "2" if put_back else "0"]
            if handed_off_by:
                args.append(handed_off_by)
        elif kind == "retry":
            args.append(max(0, retry_due_ms))
        reply = self.retry(self.scripts.store, keys, args)
        if isinstance(reply, int):  # 1: a READY result stored, the lease DONE: the common case
            return _STORED_DONE
        code, detail = reply
        return StoreResult(outcome(StoreOutcome, "store", code), as_text(detail))

    def forget(self, task_id: str, *, keep_ms: int) -> ForgetOutcome:
        """``AsyncResult.forget()``: delete the result of ``task_id``, keeping the fact that it
        is done.

        A finished task's result is replaced by a DONE tombstone that expires after
        ``keep_ms`` (a late copy of its message does not run until then); a lease in use is
        left alone. Returns ``"forgotten"`` (a finished task) or ``"deleted"``.
        """
        if keep_ms <= 0:
            raise ValueError(f"keep_ms must be positive, got {keep_ms!r}")
        keys = [self.keys.lease(_require_task_id(task_id)), self.keys.result(task_id)]
        return outcome(ForgetOutcome, "forget", self.scripts.forget(keys=keys, args=[keep_ms])[0])

    # -- reaper side --------------------------------------------------------------------

    def due_task_ids(self, limit: int, *, now_ms: int | None = None) -> list[str]:
        """Task ids whose index entry is due (a hint: :meth:`claim_due` re-validates)."""
        if limit <= 0:
            return []
        upper = now_ms if now_ms is not None else self.server_time_ms()
        members = self.client.zrangebyscore(self.keys.index, "-inf", upper, start=0, num=limit)
        ids = []
        for member in members:
            try:
                ids.append(self.keys.task_id_of(member))
            except ValueError:
                self.client.zrem(self.keys.index, member)
        return ids

    def claim_due(
        self,
        task_ids: Sequence[str],
        *,
        grace_ms: int,
        requeue_ms: int,
        abandoned_meta: Any,
        expires_ms: int,
    ) -> list[ClaimResult]:
        """Claim each given lease that is due, in one pipelined round trip.

        ``abandoned_meta(task_id, token)`` returns the encoded FAILURE meta stored for a task
        whose takeovers are exhausted; one fresh token is reserved per task for that case.
        """
        if not task_ids:
            return []
        first = self.tokens.reserve(len(task_ids))
        claims = []
        for offset, task_id in enumerate(task_ids):
            token = first + offset
            keys = [self.keys.lease(task_id), self.keys.result(task_id), self.keys.index, self.keys.abandoned]
            claims.append((keys, [grace_ms, requeue_ms, token, abandoned_meta(task_id, token), max(0, expires_ms)]))

        def send() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for keys, args in claims:
                self.scripts.claim(keys=keys, args=args, client=pipe)
            return list(pipe.execute())

        try:
            answers = send()
        except (ConnectionError, TimeoutError):
            # The server may have run the claims and the reply been lost: sent again, each
            # answers as it did (the caller runs an abandon's side effects on that answer).
            # redis-py before 6 sends a pipeline once; from 6 on it has already tried again.
            answers = send()
        results = []
        for task_id, (code, cause, flat) in zip(task_ids, answers, strict=True):
            checked = outcome(ClaimOutcome, "claim", code)
            state = LeaseState.from_flat(task_id, flat) if flat else None
            results.append(ClaimResult(task_id, checked, as_text(cause), state))
        return results

    def cancel(self, task_id: str, revoked_meta: Any, *, expires_ms: int, unknown_too: bool = False) -> CancelResult:
        """End a task for good; ``revoked_meta(token)`` encodes its REVOKED meta.

        A task id with neither lease nor result is ``"unknown"`` and nothing is stored,
        unless ``unknown_too`` (for a task still waiting in the queue). The answer also
        says what the lease was before (whether an owner held it).
        """
        keys = [
            self.keys.lease(_require_task_id(task_id)),
            self.keys.result(task_id),
            self.keys.index,
        ]
        token = self.tokens.reserve(1)
        args = [token, revoked_meta(token), max(0, expires_ms), "1" if unknown_too else "0"]
        code, previous = self.scripts.cancel(keys=keys, args=args)
        return CancelResult(outcome(CancelOutcome, "cancel", code), as_text(previous))

    def redrive(self, task_id: str) -> RedriveOutcome:
        """Put an ABANDONED task back for a fresh set of takeovers."""
        keys = [
            self.keys.lease(_require_task_id(task_id)),
            self.keys.result(task_id),
            self.keys.index,
            self.keys.abandoned,
        ]
        return outcome(RedriveOutcome, "redrive", self.scripts.redrive(keys=keys, args=[])[0])

    def lapse_now(self, task_id: str, owner_prefix: str = "", retry_due_ms: int | None = None) -> LapseNowOutcome:
        """Make a live lease due for takeover now, as if its owner were gone (for operators and tests).

        The lease is given up (``LAPSED``), so its owner, if alive, cannot renew it back
        before the reaper's next pass; that owner's next renewal is refused. With
        ``owner_prefix`` (``"<hostname>/<pid>/"``, a process the worker lost) only a lease that
        process owns is given up; with ``retry_due_ms`` too (Celery retries the lost process's
        task) it is ``RETRYING`` instead, due for a re-send only that many ms from now.
        Returns ``"lapsed"``, ``"retrying"``, ``"not-live"`` or ``"missing"``.
        """
        keys = [self.keys.lease(_require_task_id(task_id)), self.keys.index]
        if retry_due_ms is not None and not owner_prefix:
            raise ValueError("lapse_now(): retry_due_ms is for the lease of a lost process: give its owner_prefix")
        args = [owner_prefix] if owner_prefix else []
        if retry_due_ms is not None:
            args.append(str(max(0, int(retry_due_ms))))
        return outcome(LapseNowOutcome, "lapse_now", self.scripts.lapse_now(keys=keys, args=args)[0])

    def keep_trace_context(self, task_id: str, token: int, traceparent: str) -> bool:
        """Keep the owner's run span context on its live lease (for a takeover's links).

        Returns False when the lease is not that owner's live lease any more.
        """
        keys = [self.keys.lease(_require_task_id(task_id))]
        return bool(self.scripts.trace_context(keys=keys, args=[_require_token(token), traceparent]))

    # -- reads --------------------------------------------------------------------------

    def read(self, task_id: str) -> LeaseState | None:
        """Return the lease of ``task_id``, or ``None`` when it has none.

        A task finished by an owner's READY result has its lease in the result
        (:mod:`celery_fenced._lease.finished`): it is read back as the DONE lease it was, with its
        status, final token, attempt and takeovers.
        """
        fields = self.client.hgetall(self.keys.lease(_require_task_id(task_id)))
        if fields:
            return LeaseState.from_fields(task_id, {as_text(k): as_text(v) for k, v in fields.items()})
        fence = fence_of(self.client.get(self.keys.result(task_id)))
        return LeaseState.from_fields(task_id, fence.lease_fields()) if fence is not None else None

    def read_many(self, task_ids: Iterable[str]) -> list[LeaseState]:
        """Return the leases of many task ids in one round trip (missing ones left out)."""
        ids = list(task_ids)
        pipe = self.client.pipeline(transaction=False)
        for task_id in ids:
            pipe.hgetall(self.keys.lease(task_id))
        states = []
        for task_id, fields in zip(ids, pipe.execute(), strict=True):
            if fields:
                decoded = {as_text(k): as_text(v) for k, v in fields.items()}
                states.append(LeaseState.from_fields(task_id, decoded))
        return states

    def indexed_task_ids(self, limit: int = 1000) -> list[str]:
        """Task ids in the expiry index, soonest due first (live, lapsed and requeued ones)."""
        return self._task_ids(self.client.zrange(self.keys.index, 0, max(0, limit - 1)))

    def lease_task_ids(self, limit: int = 1000) -> list[str]:
        """Task ids of up to ``limit`` lease hashes, in no order (finished ones included).

        A ``SCAN`` over the keyspace, for the operator's listing of finished leases (the
        expiry index holds only the ones still due).
        """
        pattern = "".join("\\" + char if char in "*?[]\\" else char for char in self.keys.lease("\0"))
        found: list[str] = []
        for key in self.client.scan_iter(match=pattern.replace("\0", "*"), count=1000):
            found.append(self.keys.task_id_of(key))
            if len(found) >= limit:
                break
        return found

    def abandoned_task_ids(self, limit: int = 1000) -> list[str]:
        """Task ids of the dead letters (ABANDONED), oldest first.

        A dead letter whose lease expired with its result is still listed here until
        :meth:`read_many` finds it gone; :meth:`forget_abandoned` then drops it.
        """
        return self._task_ids(self.client.zrange(self.keys.abandoned, 0, max(0, limit - 1)))

    def abandoned_count(self) -> int:
        """How many dead letters there are (expired ones not yet forgotten included)."""
        return int(self.client.zcard(self.keys.abandoned))

    def live_count(self) -> int:
        """How many leases the reaper watches: held, or waiting for a worker or a retry."""
        return int(self.client.zcard(self.keys.index))

    def due_count(self, within_ms: int) -> int:
        """How many of the leases the reaper watches are due within ``within_ms`` of the
        server's clock (the index's scores: a held lease's expiry, a waiting one's eta plus
        its timeout)."""
        return int(self.client.zcount(self.keys.index, "-inf", self.server_time_ms() + within_ms))

    def forget_abandoned(self, task_ids: Iterable[str]) -> None:
        """Drop dead letters whose lease is gone (it expired with the abandoned result)."""
        members = [self.keys.lease(task_id) for task_id in task_ids]
        if members:
            self.client.zrem(self.keys.abandoned, *members)

    def _task_ids(self, members: Iterable[Any]) -> list[str]:
        ids = []
        for member in members:
            try:
                ids.append(self.keys.task_id_of(member))
            except ValueError:
                continue
        return ids

    def owner_token(self, task_id: str) -> tuple[str, int] | None:
        """Return ``(status, ownerToken)`` of a lease in one read, or ``None`` without one."""
        status, token = self.client.hmget(self.keys.lease(_require_task_id(task_id)), "status", "ownerToken")
        if status is None:
            return None
        return as_text(status), int(token or 0)

    def server_time_ms(self) -> int:
        """The Redis server's clock in milliseconds."""
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000


def is_fenced(app: Any) -> bool:
    """Whether ``app``'s result backend is the fenced one (it builds the backend if need be)."""
    return isinstance(getattr(app.backend, "lease_store", None), LeaseStore)


def lease_store_of(app: Any, needed_by: str) -> LeaseStore:
    """The lease store of ``app``'s fenced result backend.

    Raises:
        ConfigurationError: the result backend is another one; the message names
            ``needed_by`` (what needs the leases) and the backend in use.
    """
    backend = app.backend
    store = getattr(backend, "lease_store", None)
    if not isinstance(store, LeaseStore):
        raise ConfigurationError(
            f"{needed_by} needs the fenced result backend, but result_backend is "
            f"{type(backend).__name__} ({backend.as_uri()!s}): set result_backend = 'fenced+redis://HOST:PORT/DB'"
        )
    return store
