"""The owner's own, in-memory view of a lease it holds: :class:`OwnedLease`.

The task body writes progress here (no network round trip: :meth:`OwnedLease.progress` is
on the hot path); the heartbeat reads it each tick, publishes it with the renewal, and
marks it lost when the shared state says so. All clocks here are the process's monotonic
clock: the wall clock never decides anything.

An :class:`OwnedLease`'s identity (task id, owner id, token, attempt, takeovers, the run it
carries, its options) is fixed at the acquire (``Final``: the type checker refuses an
assignment), and each thing that changes has one writer:

* :class:`BodyProgress`, written only by the task's thread (:meth:`~OwnedLease.progress`, the
  ``deadline()``/``stream()`` block). It takes no lock: the heartbeat reads each field once
  per tick (a torn read costs a tick at most), and the stages the body left reach whoever
  counts them through a queue the body only appends to.
* :class:`HeartbeatWatch`, written by the heartbeat while it serves the lease: the last
  renewal, the details it published, the stall count, the activity counted so far and what
  Flower was told.
* :class:`~celery_fenced._task.interrupter.Interrupter`, the interrupt's state, under its own lock.
* the lease's end (``ended``, ``lost_reason``, ``retrying``), which both threads change, only
  under :attr:`OwnedLease.lock`, by the methods of :class:`OwnedLease`. The end takes the
  heartbeat's watch over: the heartbeat takes activity and announces to Flower only under
  that lock while the lease has not ended, and the end takes the rest and its last
  announcement once, under the same lock.

Nothing here reports anything: what the heartbeat and the end take from the lease
(:class:`Activity`) is counted and told by the worker side.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from .._celery.compat import WeakrefSlot
from .._lease.state import Checkpoint, ProgressReport
from .._telemetry.names import NameMemo
from ..conf import TaskPolicy, normalise_stage
from ..exceptions import LeaseLostError
from .details import check_details, encode_details
from .interrupter import Interrupter

__all__ = [
    "EXPIRED_LOCALLY",
    "LOCAL_EXPIRY_MARGIN",
    "Activity",
    "BodyProgress",
    "FinishedStage",
    "HeartbeatWatch",
    "OwnedLease",
    "StageDeadline",
]

#: Fraction of the TTL kept as a safety margin by the owner's local expiry check.
LOCAL_EXPIRY_MARGIN = 0.1

#: Why an owner gave its lease up on its own clock: no renewal came within the TTL (Redis
#: unreachable, a pause). Nobody refused it: the lease may still be there, or may have vanished.
EXPIRED_LOCALLY = "expired: no renewal within the lease ttl"

_monotonic = time.monotonic


# Stage names repeat: normalise each once per process.
_stage = NameMemo(normalise_stage)
_stage_names = _stage.made


@dataclass
class StageDeadline:
    """A deadline that replaces the stage table while a ``deadline()`` or ``stream()`` block runs.

    ``first``/``idle`` bound the time without progress before and after the first chunk
    (both equal ``seconds`` for a plain deadline); ``total`` bounds the whole block.
    """

    stage: str
    first: float
    idle: float
    total: float | None
    started: float
    kind: str = "deadline"
    chunks: int = 0
    first_chunk_at: float | None = None


#: ``(stage, seconds in it, longest gap between progress calls)``.
FinishedStage = tuple[str | None, float, float]

_NO_DETAILS: Mapping[str, Any] = MappingProxyType({})


class BodyProgress:
    """What the body reports: written only by the task's thread, through
    :meth:`OwnedLease.progress` (inline: it is the hot path) and the methods below.

    Attributes:
        stage: the stage of the last ``progress()`` call that gave one (normalised).
        version: ``progress()`` calls so far.
        details: the latest ``progress()`` details (replaced by each call that gives some).
        last_progress: when the last ``progress()`` call came (monotonic clock).
        stage_started: when the current stage began.
        stage_gap: the longest time between two ``progress()`` calls in the current stage.
        finished_stages: ``(stage, seconds in it, longest gap)`` of each stage the body left,
            appended here and taken by whoever counts the activity (a queue: one end each).
        block: the ``deadline()`` or ``stream()`` block running, whose deadlines replace the stage's.
        span: the attempt's recording ``run/<task>`` span (OpenTelemetry), else ``None``.
        on_stage: told each new stage (the span's recorder), else ``None``.
    """

    __slots__ = (
        "block",
        "details",
        "finished_stages",
        "last_progress",
        "on_stage",
        "span",
        "stage",
        "stage_gap",
        "stage_started",
        "version",
    )

    def __init__(self, started: float, stage: str | None = None) -> None:
        self.stage = stage
        self.version = 0
        self.details: Mapping[str, Any] = _NO_DETAILS
        self.last_progress = started
        self.stage_started = started
        self.stage_gap = 0.0
        self.finished_stages: deque[FinishedStage] = deque()
        self.block: StageDeadline | None = None
        self.span: Any = None
        self.on_stage: Callable[[str], object] | None = None

    def traced(self, span: Any, on_stage: Callable[[str], object]) -> None:
        """The body runs inside ``span``; ``on_stage`` is told each new stage."""
        self.span = span
        self.on_stage = on_stage

    def begin_block(self, block: StageDeadline) -> None:
        """A ``deadline()`` or ``stream()`` block begins: its deadlines replace the stage's."""
        self.block = block

    def end_block(self) -> None:
        """The block ended: the stage table applies again."""
        self.block = None

    def no_progress_deadline(self, now: float, policy: TaskPolicy) -> tuple[float, float, str]:
        """Return ``(seconds allowed, seconds without progress, what bounds it)`` at ``now``."""
        block = self.block
        if block is None:
            return policy.stage_timeout(self.stage), now - self.last_progress, "stage"
        if block.total is not None and now - block.started > block.total:
            return block.total, now - block.started, f"{block.kind} total timeout"
        if block.kind == "stream" and block.chunks == 0:
            return block.first, now - block.started, "first token timeout"
        if block.kind == "stream":
            return block.idle, now - self.last_progress, "idle timeout"
        return block.first, now - block.started, "deadline"


class HeartbeatWatch:
    """What the heartbeat keeps of one lease while it serves it (then the end's, see the module).

    Attributes:
        renewed: when the last accepted renewal was sent (monotonic clock).
        published_details: the details object the last accepted renewal wrote to Redis.
        stall_checks_failed: progress checks failed in a row.
        stalled_reported: the stall was reported; not again until progress.
        counted_version: the body's progress calls counted so far.
        announced: a ``task-progress`` event told Flower about this attempt (its token).
        announced_stage: the stage the last ``task-progress`` event carried.
        announced_details: the details object the last ``task-progress`` event carried.
    """

    __slots__ = (
        "announced",
        "announced_details",
        "announced_stage",
        "counted_version",
        "published_details",
        "renewed",
        "stall_checks_failed",
        "stalled_reported",
    )

    def __init__(self, started: float) -> None:
        self.renewed = started
        self.published_details: Mapping[str, Any] = _NO_DETAILS  # nothing to publish yet
        self.stall_checks_failed = 0
        self.stalled_reported = False
        self.counted_version = 0
        self.announced = False
        self.announced_stage: str | None = None
        self.announced_details: Mapping[str, Any] = _NO_DETAILS

    def renewed_at(self, sent: float, details: Mapping[str, Any] | None = None) -> None:
        """A renewal sent at ``sent`` was accepted; it wrote ``details`` (if given)."""
        self.renewed = sent
        if details is not None:
            self.published_details = details

    def progress_checked(self, in_time: bool) -> int:
        """Record one progress check; the failed checks in a row (0 after one in time)."""
        if in_time:
            self.stall_checks_failed = 0
            self.stalled_reported = False
        else:
            self.stall_checks_failed += 1
        return self.stall_checks_failed

    def stall_reported(self) -> None:
        """The stall was reported (logged, told, its ``on_stall`` applied): not again until progress."""
        self.stalled_reported = True

    def take_activity(self, body: BodyProgress, closing_at: float | None = None) -> tuple[int, list[FinishedStage]]:
        """The body's progress calls and finished stages since the last take; with
        ``closing_at`` (the attempt ends), its current stage too, as if it finished then."""
        version = body.version
        updates, self.counted_version = version - self.counted_version, version
        queued = body.finished_stages
        finished = []
        while queued:
            finished.append(queued.popleft())
        if closing_at is not None and body.stage is not None:
            gap = max(body.stage_gap, closing_at - body.last_progress)
            finished.append((body.stage, closing_at - body.stage_started, gap))
        return updates, finished

    def announce(self, body: BodyProgress) -> bool:
        """Flower is told the stage and the published details now; False when it knows them."""
        details = self.published_details
        if self.announced and body.stage == self.announced_stage and details is self.announced_details:
            return False
        self.announced = True
        self.announced_stage = body.stage
        self.announced_details = details
        return True

    def announce_the_end(self, body: BodyProgress) -> bool:
        """The attempt ends: True when Flower knows it and not its last stage or details yet."""
        if not self.announced or (body.stage == self.announced_stage and body.details is self.announced_details):
            return False
        self.announced_stage = body.stage
        self.announced_details = body.details
        return True


#: What the body did since the activity was last taken, for the process's metrics:
#: ``(progress() calls, finished stages, sample the gaps, announce)``. The gaps are samples of
#: what the stages need unless the owner was lost (its last gap is its stall); ``announce``
#: says that the attempt ends and Flower knows it but not its last stage or details yet.
Activity = tuple[int, list[FinishedStage], bool, bool]


class OwnedLease(WeakrefSlot):
    """One attempt's lease, as its owner process sees it: its identity fixed at the acquire,
    what changes in parts of one writer each (see the module).

    Attributes:
        task_id: the task id.
        task_name: the task's registered name.
        owner_id: ``"<hostname>/<pid>/<attempt id>"``.
        token: the fencing token of this attempt.
        attempt: executions of this task id that acquired, this one included.
        takeovers: reaper claims of this task id before this attempt.
        policy: the lease options in force.
        call: the original call recorded at acquire (written again if the lease vanishes).
        publish_id: the ``apply_async`` whose message this attempt runs (``""`` when none).
        handed_off_by: the token of the hand-off that started this run, as its message names it
            (``""`` when none: not a replacement's run).
        checkpoint: what an earlier owner of the task id published (``None`` on a first attempt).
        started: when the attempt acquired (monotonic clock).
        expiry_window: seconds after a renewal past which the owner gives the lease up itself.
        body: what the body reports (:class:`BodyProgress`).
        watch: what the heartbeat keeps (:class:`HeartbeatWatch`).
        interrupter: whether the body may be interrupted now
            (:class:`~celery_fenced._task.interrupter.Interrupter`).
        ended: the attempt ended its lease (a result write, a release, a hand-off).
        lost_reason: why the lease is lost, else ``None``.
        retrying: the lease was moved to RETRYING before ``retry()`` sent the retry message.
        lock: taken by every change of the three above (the lease's end), by the methods below.

    The attributes above ``body`` are ``Final`` (the type checker refuses an assignment), as
    are the parts themselves: one written by another writer would break the module's rules.
    """

    __slots__ = (
        "attempt",
        "body",
        "call",
        "checkpoint",
        "ended",
        "expiry_window",
        "handed_off_by",
        "interrupter",
        "lock",
        "lost_reason",
        "owner_id",
        "policy",
        "publish_id",
        "retrying",
        "started",
        "takeovers",
        "task_id",
        "task_name",
        "token",
        "watch",
    )

    def __init__(
        self,
        task_id: str,
        task_name: str,
        owner_id: str,
        token: int,
        attempt: int,
        takeovers: int,
        policy: TaskPolicy,
        *,
        call: Mapping[str, Any] | None = None,
        publish_id: str = "",
        handed_off_by: str = "",
        checkpoint: Checkpoint | None = None,
        started: float | None = None,
        runner: Any = None,
    ) -> None:
        if started is None:
            started = _monotonic()
        self.task_id: Final = task_id
        self.task_name: Final = task_name
        self.owner_id: Final = owner_id
        self.token: Final = token
        self.attempt: Final = attempt
        self.takeovers: Final = takeovers
        self.policy: Final = policy
        self.call: Final = call
        self.publish_id: Final = publish_id
        self.handed_off_by: Final = handed_off_by
        self.checkpoint: Final = checkpoint
        self.started: Final = started
        # The local expiry check: renewal + TTL less the safety margin.
        self.expiry_window: Final = policy.lease_ttl * (1 - LOCAL_EXPIRY_MARGIN)
        self.body: Final = BodyProgress(started)
        self.watch: Final = HeartbeatWatch(started)
        self.interrupter: Final = Interrupter(threading.get_ident(), runner)
        self.ended = False
        self.lost_reason: str | None = None
        self.retrying = False
        self.lock: Final = threading.Lock()

    def __repr__(self) -> str:
        return f"OwnedLease({self.task_name}[{self.task_id}] token={self.token} owner={self.owner_id})"

    # -- what the parts say, for readers --------------------------------------------------------

    @property
    def stage(self) -> str | None:
        """The stage the body last reported."""
        return self.body.stage

    @property
    def version(self) -> int:
        """The body's ``progress()`` calls so far."""
        return self.body.version

    @property
    def details(self) -> Mapping[str, Any]:
        """The latest details the body reported."""
        return self.body.details

    @property
    def span(self) -> Any:
        """The attempt's recording ``run/<task>`` span, else ``None``."""
        return self.body.span

    @property
    def published_details(self) -> Mapping[str, Any]:
        """The details object the last accepted renewal wrote to Redis."""
        return self.watch.published_details

    @property
    def renewed(self) -> float:
        """When the last accepted renewal was sent (monotonic clock)."""
        return self.watch.renewed

    @property
    def body_done(self) -> bool:
        """The body returned or raised."""
        return self.interrupter.body_done

    # -- the body's side (hot path) ---------------------------------------------------------

    def progress(self, stage: str | None = None, details: Mapping[str, Any] | None = None) -> None:
        """Record real progress: in memory only, no network round trip."""
        now = _monotonic()
        if self.lost_reason is not None or now - self.watch.renewed > self.expiry_window:
            self.raise_if_lost(now)
        # The body's part, written here inline (the hot path: no further call), in its thread.
        body = self.body
        if details:
            check_details(details, self.policy.max_detail_bytes)
            body.details = details
        gap = now - body.last_progress  # bounded by the deadline of the stage it ends
        if gap > body.stage_gap:
            body.stage_gap = gap
        if stage is not None:
            try:
                normal = _stage_names[stage]
            except KeyError:
                normal = _stage(stage)
            if normal != body.stage:
                # A stage change: keep the finished stage's duration and longest gap between
                # progress calls for whoever counts the activity.
                body.finished_stages.append((body.stage, now - body.stage_started, body.stage_gap))
                body.stage_started = now
                body.stage_gap = 0.0
                body.stage = normal
                if body.on_stage is not None:
                    body.on_stage(normal)
        body.version += 1
        body.last_progress = now

    def raise_if_lost(self, now: float | None = None) -> None:
        """Raise :class:`LeaseLostError` once the lease is lost or may have expired.

        The second test needs no network: the last successful renewal plus the TTL (less
        a margin) has passed on the local monotonic clock, so an owner resumed after
        SIGSTOP, a GC or a VM pause stops before its heartbeat has run again.
        """
        lost_reason = self.lost_reason
        if lost_reason is not None:
            raise LeaseLostError(self.task_id, self.token, lost_reason)
        if now is None:
            now = time.monotonic()
        if now - self.watch.renewed > self.expiry_window:
            self.mark_lost(EXPIRED_LOCALLY)
            raise LeaseLostError(self.task_id, self.token, self.lost_reason or EXPIRED_LOCALLY)

    # -- what the heartbeat reads -----------------------------------------------------------

    def report(self, now: float) -> tuple[ProgressReport, Mapping[str, Any]]:
        """The progress to publish at ``now``, and the details object it carries.

        The details are encoded only when they changed since the last accepted renewal;
        hand the object to :meth:`HeartbeatWatch.renewed_at` once a renewal wrote them.
        """
        body = self.body
        details = body.details  # read first: a progress() call in between is sent next time
        text = encode_details(details) if details is not self.watch.published_details else ""
        age_ms = int((now - body.last_progress) * 1000)
        return ProgressReport(body.stage or "", body.version, age_ms, text), details

    def no_progress_deadline(self, now: float) -> tuple[float, float, str]:
        """Return ``(seconds allowed, seconds without progress, what bounds it)`` at ``now``."""
        return self.body.no_progress_deadline(now, self.policy)

    # -- what the heartbeat takes while it serves the lease (under the lock) -------------------

    def take_activity(self) -> Activity | None:
        """Progress calls and finished stages since the last take; ``None`` once the lease
        ended (its end took the rest)."""
        with self.lock:
            if self.ended:
                return None
            updates, finished = self.watch.take_activity(self.body)
            return updates, finished, self.lost_reason is None, False

    def announce(self) -> bool:
        """Flower is to be told this attempt's stage and published details now; False when it
        knows them already, or the lease ended (the end tells it)."""
        with self.lock:
            return not self.ended and self.watch.announce(self.body)

    # -- the end of the lease (either thread, under the lock) -----------------------------------

    def _last_activity(self) -> Activity:
        """The activity not taken yet, the current stage closed (the lock held, the lease ending)."""
        watch, body = self.watch, self.body
        updates, finished = watch.take_activity(body, closing_at=_monotonic())
        announce = watch.announced and watch.announce_the_end(body)  # most attempts were never announced
        return updates, finished, self.lost_reason is None, announce

    def end(self) -> Activity | None:
        """A result write ended the lease: the activity not counted yet; ``None`` if it had
        ended before."""
        with self.lock:
            if self.ended:
                return None
            self.ended = True
            return self._last_activity()

    def stop_serving(self) -> Activity | None:
        """The attempt ends its lease itself: the activity not counted yet when it was live;
        ``None`` when it had ended or was lost."""
        with self.lock:
            live = not self.ended and self.lost_reason is None
            self.ended = True
            return self._last_activity() if live else None

    def mark_lost(self, reason: str) -> bool:
        """Mark the lease lost; True the first time (so callers report it once)."""
        with self.lock:
            if self.lost_reason is not None or self.ended:
                return False
            self.lost_reason = reason
            return True

    def refused(self, what: str) -> str:
        """The end the attempt asked for was refused: the lease is lost; the reason."""
        with self.lock:
            self.lost_reason = self.lost_reason or what
            return self.lost_reason

    def mark_retrying(self) -> None:
        """The lease was moved to RETRYING before ``retry()`` sends its message."""
        with self.lock:
            self.retrying = True
