"""The per-process heartbeat: one daemon thread renews every lease the process holds.

Each tick it checks, for each lease, that the body made progress within the deadline of its
current stage; inside it, the lease is renewed (all leases of the process in one round
trip); past it for ``stall_checks`` ticks in a row, ``on_stall`` applies. A Redis error in a
tick is logged and retried on the next one; it never kills the thread. If renewals keep
failing until the lease may have expired, the body is told (the lease is marked lost).

The thread holds only weak references to the leases it serves and loops on
``Event.wait(interval)``, so stopping it is immediate. On the gevent pool it is a greenlet of
the tasks' hub (see :mod:`celery_fenced._worker.greenlets` for why).

While it serves leases it wakes every :data:`STOPPING_POLL` seconds between ticks, for two
things a tick alone would miss:

* the worker began to stop (a warm shutdown: SIGTERM, then often SIGKILL once a grace runs
  out). Celery tells only the worker's main process, so the heartbeat of every process looks
  at the worker's shared flag (:attr:`~celery_fenced._worker.process.WorkerProcess.stopping`);
  from then on each lease whose body reported new details is renewed at once, so the details
  are in Redis before the worker is killed, and the next owner's ``self.checkpoint`` has them;
* the process did not run (SIGSTOP, a VM pause): a wake that comes more than a tick interval
  late marks a *silence*, which :meth:`Heartbeat.silent_between` reports. A takeover during a
  silence was right, whatever the owner does once it thaws (see
  :func:`celery_fenced._worker.attempt.false_takeover`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Protocol

from redis.exceptions import RedisError

from .._lease.state import LapseOutcome, RenewOutcome, RenewRequest, RestoreOutcome
from .._lease.store import LeaseStore
from .._task.owner import EXPIRED_LOCALLY, LOCAL_EXPIRY_MARGIN, OwnedLease
from .._telemetry.process import TELEMETRY
from .loop import TickLoop
from .process import WORKER_PROCESS

__all__ = ["REFUSALS", "SILENCES_KEPT", "STOPPING_POLL", "Heartbeat", "HeartbeatListener", "take_back", "write_back"]

logger = logging.getLogger("celery_fenced.heartbeat")

#: Why a renewal was refused, in words for the log and for LeaseLostError.
REFUSALS = {
    "stale-token": "taken over: a newer token owns the task",
    "not-owner": "taken over: another owner holds the lease",
    "claimed": "claimed by the reaper",
    "lapsed": "given up",
    "finished": "the task was ended (result stored)",
    "cancelled": "cancelled (celery fenced cancel)",
    "retrying": "the task is retrying",
    "missing": "the lease is gone from Redis",
}

#: While it serves leases, the heartbeat wakes at least this often (seconds) between ticks:
#: once the worker is stopping, new details reach Redis within this long.
STOPPING_POLL = 0.25

#: The most silences (spans in which the heartbeat did not run) a heartbeat keeps.
SILENCES_KEPT = 64


class HeartbeatListener(Protocol):
    """What the heartbeat tells the rest of the package.

    A worker's listener is :class:`~celery_fenced._worker.listener.WorkerListener`.
    """

    def lost(self, lease: OwnedLease, reason: str) -> None:
        """The lease is lost: tell the body (and interrupt it where configured)."""

    def stalled(self, lease: OwnedLease, bound: str, allowed: float, elapsed: float) -> None:
        """The lease made no progress for ``stall_checks`` ticks; ``on_stall`` is being applied."""

    def released(self, lease: OwnedLease) -> None:
        """A stalled lease was given up (``on_stall="release"``): ask for a reap now."""

    def duration_exceeded(self, lease: OwnedLease) -> None:
        """The attempt ran past ``max_task_duration``: end it (FAILURE stored)."""

    def renewed(self, leases: list[OwnedLease]) -> None:
        """These leases were renewed (stage changes are published from here)."""


class Heartbeat:
    """The heartbeat thread of one process.

    Args:
        store_factory: returns the :class:`LeaseStore` to use (called in the thread).
        listener: told of stalls, losses and renewals.
        default_interval: the tick period when no lease asks for a shorter one.
        clock: the monotonic clock (injectable for tests).
    """

    def __init__(
        self,
        store_factory: Callable[[], LeaseStore],
        listener: HeartbeatListener,
        default_interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store_factory = store_factory
        self._listener = listener
        self._default_interval = default_interval
        self._clock = clock
        # Weak references without a callback (a callback's reference costs each task more
        # than the rest of its registration): leases dropped without unregister() are pruned
        # when the leases are read.
        self._leases: dict[str, weakref.ref[OwnedLease]] = {}
        self._loop = TickLoop("celery-fenced-heartbeat", self._step)
        self._store: LeaseStore | None = None
        self._waiting = default_interval  # the tick interval under way, seconds
        self._next_tick = 0.0  # when the next tick is due (monotonic clock)
        self._due: float | None = None  # when the thread is to wake next; None while it runs a step
        self._silences: deque[tuple[float, float]] = deque(maxlen=SILENCES_KEPT)
        self._told_stopping = False
        # Leases given up on the local clock while Redis could not be reached, by task id: once
        # it answers, one whose hash vanished meanwhile (a failover that lost writes) is written
        # back for a takeover, or nobody would ever finish its task.
        self._expired_unseen: dict[str, OwnedLease] = {}

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (idempotent)."""
        self._loop.start()
        logger.debug("heartbeat started")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and join it."""
        self._loop.stop(timeout)
        logger.debug("heartbeat stopped")

    def register(self, lease: OwnedLease) -> None:
        """Serve a new lease (starts the thread if needed).

        A lease whose heartbeat interval is shorter than the wait under way wakes the
        thread, which then ticks and waits the shorter interval: it is renewed in time. The
        first lease of an idle thread wakes it too, so it looks for the worker's stop from
        now on (:data:`STOPPING_POLL`).
        """
        idle = not self._leases
        self.serve(lease)
        if self._loop.thread is None or self._loop.stopping:  # the thread runs until stop()
            self.start()
        elif lease.policy.heartbeat_interval < self._waiting:
            self._next_tick = self._clock()
            self._loop.wake()
        elif idle:
            self._loop.wake()

    def serve(self, lease: OwnedLease) -> None:
        """Serve a lease without starting the thread (for a caller that runs :meth:`tick`)."""
        self._leases[lease.owner_id] = weakref.ref(lease)

    def unregister(self, lease: OwnedLease) -> None:
        """Stop serving a lease; one given up on the local clock is looked at once Redis answers
        (:meth:`_write_back_vanished`)."""
        self._leases.pop(lease.owner_id, None)
        if lease.lost_reason == EXPIRED_LOCALLY:
            self._expired_unseen[lease.task_id] = lease  # one dict operation: no lock needed

    def leases(self) -> list[OwnedLease]:
        """The leases served now."""
        served = []
        for owner_id, ref in list(self._leases.items()):
            lease = ref()
            if lease is None:
                self._leases.pop(owner_id, None)
            else:
                served.append(lease)
        return served

    # -- the loop ---------------------------------------------------------------------------

    def _interval(self) -> float:
        intervals = [lease.policy.heartbeat_interval for lease in self.leases()]
        return min(intervals, default=self._default_interval)

    def _step(self) -> float:
        """One wake of the thread: a tick when one is due, else what the worker's stop asks
        for; the seconds until the next wake."""
        now = self._clock()
        self._note_silence(now)
        if now >= self._next_tick:
            try:
                self.tick()
                self._waiting = self._interval()
            except Exception:  # the thread must never die silently
                logger.exception("heartbeat tick failed; retrying on the next tick")
                self._waiting = self._default_interval
            self._next_tick = self._clock() + self._waiting
        elif WORKER_PROCESS.stopping.is_set():
            try:
                self.publish_details()
            except Exception:
                logger.exception("publishing the details of a stopping worker failed; retrying")
        now = self._clock()
        wait = max(0.0, self._next_tick - now)
        if self._leases:
            wait = min(wait, STOPPING_POLL)
        self._due = now + wait
        return wait

    def _note_silence(self, now: float) -> None:
        """The thread woke at ``now``: a wake more than a tick interval late was a silence."""
        due, self._due = self._due, None
        if due is not None and now - due > self._waiting:
            self._silences.append((due, now))

    def silent_between(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` (monotonic clock) in which this process did not run:
        its heartbeat woke more than a tick interval late (SIGSTOP, a VM pause), or has not
        woken yet though it is that late at ``end``.

        Only the silences seen by the heartbeat's own thread count: a heartbeat ticked by
        hand (:meth:`tick`) sees none.
        """
        spans = list(self._silences)
        due = self._due
        if due is not None and end - due > self._waiting:
            spans.append((due, end))  # not woken yet: silent until now
        return sum(max(0.0, min(stop, end) - max(begin, start)) for begin, stop in spans)

    def publish_details(self) -> None:
        """The worker is stopping: renew at once each lease whose body reported details its
        last renewal did not publish, so they are in Redis should the worker be killed before
        the body ends (the next owner resumes from them).

        A lease past its deadline is left to the tick: a stop never renews a stalled lease.
        """
        now = self._clock()
        batch: list[tuple[OwnedLease, bool]] = []
        for lease in self.leases():
            if lease.ended or lease.lost_reason is not None or lease.details is lease.published_details:
                continue
            allowed, elapsed, _ = lease.no_progress_deadline(now)
            if elapsed <= allowed:
                batch.append((lease, False))
        if not batch:
            return
        if not self._told_stopping:
            self._told_stopping = True
            logger.info("worker stopping: publishing the latest details of %d running task(s)", len(batch))
        self._renew(batch)

    def tick(self) -> None:
        """One pass over every lease served: check progress, renew or apply ``on_stall``."""
        now = self._clock()
        if self._expired_unseen:
            self._write_back_vanished()
        batch: list[tuple[OwnedLease, bool]] = []
        for lease in self.leases():
            if lease.ended or lease.lost_reason is not None:
                self.unregister(lease)
                continue
            limit = lease.policy.max_task_duration
            if limit is not None and now - lease.started > limit:
                self._listener.duration_exceeded(lease)
                continue
            TELEMETRY.metrics.inc("owner_heartbeat_total")
            activity = lease.take_activity()
            if activity is not None:
                updates, stages, sample_gaps, _ = activity
                TELEMETRY.metrics.count_activity(updates, stages, sample_gaps=sample_gaps, task=lease.task_name)
            renew, stalled = self._check_progress(lease, now)
            if renew:
                batch.append((lease, stalled))
        if batch:
            self._renew(batch)
        self._flush_metrics()

    def _flush_metrics(self) -> None:
        with contextlib.suppress(RedisError):
            TELEMETRY.metrics.flush(self._get_store())

    def _check_progress(self, lease: OwnedLease, now: float) -> tuple[bool, bool]:
        """Return ``(renew, stalled)`` for one lease, applying ``on_stall`` when due."""
        allowed, elapsed, bound = lease.no_progress_deadline(now)
        watch = lease.watch
        failed = watch.progress_checked(elapsed <= allowed)
        if not failed:
            return True, False
        policy = lease.policy
        if failed < policy.stall_checks:
            return True, False
        if not watch.stalled_reported:
            TELEMETRY.metrics.inc("owner_no_progress_timeout_total")
            if bound == "idle timeout":
                TELEMETRY.metrics.inc("owner_stream_idle_timeout_total")
            logger.warning(
                "lease stalled: task %s[%s] stage=%s token=%s: no progress for %.1fs (%s %.1fs), on_stall=%s",
                lease.task_name,
                lease.task_id,
                lease.stage,
                lease.token,
                elapsed,
                bound,
                allowed,
                policy.on_stall,
            )
            self._listener.stalled(lease, bound, allowed, elapsed)
        if policy.on_stall == "alert":
            watch.stall_reported()
            return True, True
        if policy.on_stall == "expire":
            if not watch.stalled_reported and self._lapse(lease, "expire", bound):
                watch.stall_reported()
                # No renewal comes any more: the owner is told now (event, signal, interrupt),
                # not only when its local expiry check fires.
                self._lose(lease, f"stalled: no progress within the {bound} ({allowed:g}s); left to expire")
            return False, True
        if self._lapse(lease, "release", bound):
            watch.stall_reported()
            if self._lose(lease, f"stalled: no progress within the {bound} ({allowed:g}s)"):
                self._listener.released(lease)
        return False, True

    def _lapse(self, lease: OwnedLease, mode: str, bound: str) -> bool:
        try:
            progress, _ = lease.report(self._clock())
            store = self._get_store()
            code = store.lapse(lease.task_id, lease.owner_id, lease.token, mode=mode, progress=progress)
            if code == LapseOutcome.MISSING:
                restored = self._restore(lease)
                if restored == RestoreOutcome.RESTORED:
                    # Its hash vanished (a failover that lost writes): written back, then given
                    # up, so the reaper still takes the task over.
                    code = store.lapse(lease.task_id, lease.owner_id, lease.token, mode=mode, progress=progress)
                elif restored in (RestoreOutcome.FINISHED, RestoreOutcome.STALE_TOKEN):
                    code = restored.value  # finished, under this token or another
        except RedisError as exc:
            logger.warning("could not report the stall of task %s: %r; retrying", lease.task_id, exc)
            return False
        if code != LapseOutcome.OK:
            self._lose(lease, REFUSALS.get(code, code))
        return True

    def _renew(self, batch: list[tuple[OwnedLease, bool]]) -> None:
        sent = self._clock()
        reports = [lease.report(sent) for lease, _ in batch]
        requests = [
            RenewRequest(
                task_id=lease.task_id,
                owner_id=lease.owner_id,
                token=lease.token,
                ttl_ms=lease.policy.lease_ttl_ms,
                progress=report,
                stalled=stalled,
            )
            for (lease, stalled), (report, _) in zip(batch, reports, strict=True)
        ]
        try:
            codes = self._get_store().renew_many(requests)
        except RedisError as exc:
            logger.warning("lease renewal failed (%r); retrying on the next tick", exc)
            self._store = None
            for lease, _ in batch:
                if sent - lease.renewed > lease.policy.lease_ttl * (1 - LOCAL_EXPIRY_MARGIN):
                    self._lose(lease, EXPIRED_LOCALLY)
            return
        renewed = []
        for (lease, _), (_, details), code in zip(batch, reports, codes, strict=True):
            if code == RenewOutcome.MISSING:
                restored = self._restore(lease)
                if restored == RestoreOutcome.RESTORED:
                    lease.watch.renewed_at(sent)
                    renewed.append(lease)
                    continue
                if restored in (RestoreOutcome.FINISHED, RestoreOutcome.STALE_TOKEN):
                    # A finished task's lease lives on in its result: the restore read it, and
                    # answers as a renewal of a DONE lease would.
                    code = RenewOutcome(restored.value)
            if code == RenewOutcome.OK:
                lease.watch.renewed_at(sent, details)
                renewed.append(lease)
                TELEMETRY.metrics.inc("owner_lease_renew_total")
            elif code in (RenewOutcome.FINISHED, RenewOutcome.CANCELLED) and lease.body_done:
                # The body's own result write ended the lease while this renewal was in
                # flight: nothing was lost (a cancel that raced the write is reported by
                # the write, which is then refused).
                self.unregister(lease)
            else:
                TELEMETRY.metrics.inc("owner_lease_renew_rejected_total")
                self._lose(lease, f"renewal refused: {REFUSALS.get(code, code)}")
        if renewed:
            self._listener.renewed(renewed)

    def _restore(self, lease: OwnedLease) -> RestoreOutcome | None:
        """Write back a lease whose hash vanished (eviction, FLUSH, a failover): what
        ``restore.lua`` answered, ``None`` when it was not asked (or could not be).

        The owner keeps running under its token and the reaper can still re-send the task:
        neither stops in silence. Where another delivery acquired it meanwhile, the next
        renewal is refused as usual. A lease its attempt ended meanwhile (its result write,
        which leaves the lease in the result) is left alone: ``"finished"``. A lease that
        could have expired (its last renewal a TTL ago or more: a frozen owner) is not written
        back (``"expired"``): another owner may have been given the task since.
        """
        if lease.ended:
            return RestoreOutcome.FINISHED
        if lease.lost_reason is not None:
            return None
        try:
            store = self._get_store()
            code = write_back(store, lease, self._clock())
            if code == RestoreOutcome.EXPIRED:
                # Frozen (or cut off) for a TTL or more: not its lease any more, but it may have
                # been the task's only owner, and nothing else in Redis would run the task now.
                # Written back given up, due a TTL later (a newer owner still live writes its
                # own back over it first), for the reaper to re-send.
                if write_back(store, lease, self._clock(), lapsed=True) == RestoreOutcome.RESTORED:
                    logger.warning(
                        "lease written back for a takeover: task %s[%s] token=%s: its hash vanished from "
                        "Redis, and its last renewal is a TTL or more ago",
                        lease.task_name,
                        lease.task_id,
                        lease.token,
                    )
                return code
        except RedisError as exc:
            logger.warning("could not restore the vanished lease of task %s: %r", lease.task_id, exc)
            return None
        if code != RestoreOutcome.RESTORED:
            return code
        logger.warning(
            "lease restored: task %s[%s] token=%s: its hash had vanished from Redis (eviction, FLUSH "
            "or a failover that lost writes)",
            lease.task_name,
            lease.task_id,
            lease.token,
        )
        return code

    def _write_back_vanished(self) -> None:
        """For each lease given up on the local clock: if its hash vanished meanwhile (a failover
        that lost writes, an eviction), write it back and give it up, so the reaper re-sends the
        task at once. Where Redis still does not answer, the rest wait for the next tick."""
        store = self._get_store()
        for task_id, lease in list(self._expired_unseen.items()):
            try:
                vanished = store.owner_token(task_id) is None
                if vanished and write_back(store, lease, self._clock(), lapsed=True) == RestoreOutcome.RESTORED:
                    logger.warning(
                        "lease written back for a takeover: task %s[%s] token=%s: its hash vanished from "
                        "Redis while this owner could not renew it",
                        lease.task_name,
                        task_id,
                        lease.token,
                    )
                    self._listener.released(lease)
            except RedisError:
                self._store = None
                return
            self._expired_unseen.pop(task_id, None)

    def _lose(self, lease: OwnedLease, reason: str) -> bool:
        """Mark a lease lost, log it once and tell the listener; True the first time."""
        first = lease.mark_lost(reason)
        self.unregister(lease)
        if not first:
            return False
        logger.warning(
            "lease lost: task %s[%s] stage=%s token=%s: %s",
            lease.task_name,
            lease.task_id,
            lease.stage,
            lease.token,
            reason,
        )
        self._listener.lost(lease, reason)
        return True

    def _get_store(self) -> LeaseStore:
        if self._store is None:
            self._store = self._store_factory()
        return self._store


def write_back(store: LeaseStore, lease: OwnedLease, now: float, *, lapsed: bool = False) -> RestoreOutcome:
    """Write a vanished lease back as its owner holds it (``restore.lua``), if its last
    renewal (at ``now`` on the monotonic clock) is less than a TTL ago; with ``lapsed``,
    given up, for the reaper to re-send, whatever that age."""
    return store.restore(
        lease.task_id,
        lease.owner_id,
        lease.token,
        ttl_ms=lease.policy.lease_ttl_ms,
        task_name=lease.task_name,
        call=lease.call,
        attempt=lease.attempt,
        takeovers=lease.takeovers,
        max_takeovers=lease.policy.max_takeovers,
        renewal_age_ms=int((now - lease.renewed) * 1000),
        stage=lease.stage or "",
        lapsed=lapsed,
        publish_id=lease.publish_id,
        handed_off_by=lease.handed_off_by,
    )


def take_back(store: LeaseStore, lease: OwnedLease, before: str) -> bool:
    """The lease of an owner about to end its attempt (``before``: its result write, its chain
    step, its hand-off) is gone from Redis: the store lost data (a FLUSHDB, a restart without
    persistence, a failover that lost writes, an eviction), and a newer owner's lease may have
    gone with it. True when the lease is the owner's again, and only then may it go on.

    It is written back (``restore.lua``) as the heartbeat writes back a vanished lease: only
    for an owner never told it lost whose last renewal is less than a TTL ago, so nobody else
    can have been given the task (a thawed owner never gets it back), and never over a newer
    token's lease. Past that age it is written back given up (LAPSED, due a TTL later: a newer
    owner still live writes its own back first) for the reaper to re-send the task, and the
    owner goes on with nothing: it stores no result, sends no step, hands nothing off.
    """
    if lease.lost_reason is not None:
        return False
    code = write_back(store, lease, time.monotonic())
    if code == RestoreOutcome.RESTORED:
        logger.warning(
            "lease restored: task %s[%s] token=%s: its hash had vanished from Redis before its %s",
            lease.task_name,
            lease.task_id,
            lease.token,
            before,
        )
        return True
    lease.mark_lost(f"its lease vanished from Redis before its {before}: {code}")
    if code == RestoreOutcome.EXPIRED and write_back(store, lease, time.monotonic(), lapsed=True) == (
        RestoreOutcome.RESTORED
    ):
        logger.warning(
            "task %s[%s] token=%s: its lease vanished from Redis before its %s, and could have expired: "
            "given up for a takeover, nothing sent or stored",
            lease.task_name,
            lease.task_id,
            lease.token,
            before,
        )
    return False
