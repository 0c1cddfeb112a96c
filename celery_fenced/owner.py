"""The owner's own, in-memory view of a lease it holds: :class:`OwnedLease`.

The task body writes progress here (no network round trip: :meth:`OwnedLease.progress` is
on the hot path); the heartbeat reads it each tick, publishes it with the renewal, and
marks it lost when the shared state says so. All clocks here are the process's monotonic
clock: the wall clock never decides anything.

Every change of an attempt's lease is a method of :class:`OwnedLease`, in two halves:

* the body's half (:meth:`~OwnedLease.progress`, the ``deadline()``/``stream()`` block,
  :meth:`~OwnedLease.finish_body`, the shield) runs in the task's thread. Progress takes no
  lock: it writes fields only that thread writes, and the heartbeat reads each field once
  per tick (a torn read costs a tick at most).
* the heartbeat's half (:meth:`~OwnedLease.report`, :meth:`~OwnedLease.renewed_at`,
  :meth:`~OwnedLease.mark_lost`, :meth:`~OwnedLease.note_stall`) runs in the heartbeat's
  thread.

What both halves change, the lease's end (``ended``, ``lost_reason``, ``retrying``) and the
interrupt's state (``body_done``, ``shield_depth``, ``interrupt_pending``,
``interrupt_sent``), is changed only under :attr:`OwnedLease.lock`, by the methods below.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import metrics, tracing
from .compat import WeakrefSlot
from .conf import TaskPolicy, normalise_stage
from .details import check_details, encode_details
from .exceptions import LeaseLostError
from .names import NameMemo
from .state import Checkpoint, ProgressReport

__all__ = [
    "EXPIRED_LOCALLY",
    "LOCAL_EXPIRY_MARGIN",
    "OwnedLease",
    "StageDeadline",
    "current_lease",
    "set_current_lease",
]

#: Fraction of the TTL kept as a safety margin by the owner's local expiry check.
LOCAL_EXPIRY_MARGIN = 0.1

#: Why an owner gave its lease up on its own clock: no renewal came within the TTL (Redis
#: unreachable, a pause). Nobody refused it: the lease may still be there, or may have vanished.
EXPIRED_LOCALLY = "expired: no renewal within the lease ttl"

_monotonic = time.monotonic


class _ThreadState(threading.local):
    lease: OwnedLease | None = None


thread_state = _ThreadState()


def current_lease() -> OwnedLease | None:
    """The lease of the attempt this thread is running, if any (a thread-local read)."""
    return thread_state.lease


def set_current_lease(lease: OwnedLease | None) -> None:
    """Make ``lease`` this thread's running attempt (``None`` when it ends)."""
    thread_state.lease = lease


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


@dataclass(eq=False, slots=True)
class OwnedLease(WeakrefSlot):
    """One attempt's lease, as its owner process sees it.

    Attributes:
        task_id: the task id.
        task_name: the task's registered name.
        owner_id: ``"<hostname>/<pid>/<attempt id>"``.
        token: the fencing token of this attempt.
        attempt: executions of this task id that acquired, this one included.
        takeovers: reaper claims of this task id before this attempt.
        policy: the lease options in force.
        call: the original call recorded at acquire (written again if the lease vanishes).
        thread_id: the thread running the body (for an interrupt).
        runner: the greenlet running the body on the gevent pool (for an interrupt), else ``None``.
        ended: the attempt ended its lease (a result write, a release, a hand-off).
        retrying: the lease was moved to RETRYING before ``retry()`` sent the retry message.
        details: the latest ``progress()`` details (replaced by each call that gives some).
        published_details: the details object the last accepted renewal wrote to Redis.
        announced: a ``task-progress`` event told Flower about this attempt (its token).
        announced_stage: the stage the last ``task-progress`` event carried.
        announced_details: the details object the last ``task-progress`` event carried.
        checkpoint: what an earlier owner of the task id published (``None`` on a first attempt).
        publish_id: the ``apply_async`` whose message this attempt runs (``""`` when none).
        span: the attempt's recording ``run/<task>`` span (OpenTelemetry), else ``None``.
    """

    task_id: str
    task_name: str
    owner_id: str
    token: int
    attempt: int
    takeovers: int
    policy: TaskPolicy
    call: Mapping[str, Any] | None = field(default=None, repr=False)
    thread_id: int = field(default_factory=threading.get_ident)
    runner: Any = field(default=None, repr=False)
    stage: str | None = None
    version: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    renewed: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)
    details: Mapping[str, Any] = field(default_factory=dict)
    published_details: Mapping[str, Any] | None = None
    announced_details: Mapping[str, Any] | None = None
    checkpoint: Checkpoint | None = None
    publish_id: str = ""
    span: Any = field(default=None, repr=False)
    lost_reason: str | None = None
    ended: bool = False
    retrying: bool = False
    body_done: bool = False
    stall_checks_failed: int = 0
    stalled_reported: bool = False
    deadline: StageDeadline | None = None
    announced: bool = False
    announced_stage: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    expiry_window: float = 0.0
    stage_started: float = field(default_factory=time.monotonic)
    stage_gap: float = 0.0
    stage_log: list[tuple[str | None, float, float]] = field(default_factory=list, repr=False)
    counted_version: int = 0
    shield_depth: int = 0
    interrupt_pending: bool = False
    interrupt_sent: bool = False

    def __post_init__(self) -> None:
        # The local expiry check: renewal + TTL less the safety margin.
        self.expiry_window = self.policy.lease_ttl * (1 - LOCAL_EXPIRY_MARGIN)
        self.published_details = self.announced_details = self.details  # nothing to publish yet

    # -- the body's side (hot path) ---------------------------------------------------------

    def progress(self, stage: str | None = None, details: Mapping[str, Any] | None = None) -> None:
        """Record real progress: in memory only, no network round trip."""
        now = _monotonic()
        if self.lost_reason is not None or now - self.renewed > self.expiry_window:
            self.raise_if_lost(now)
        if details:
            check_details(details, self.policy.max_detail_bytes)
            self.details = details
        gap = now - self.last_progress  # bounded by the deadline of the stage it ends
        if gap > self.stage_gap:
            self.stage_gap = gap
        if stage is not None:
            try:
                normal = _stage_names[stage]
            except KeyError:
                normal = _stage(stage)
            if normal != self.stage:
                # A stage change: keep the finished stage's duration and longest gap between
                # progress calls for the heartbeat.
                self.stage_log.append((self.stage, now - self.stage_started, self.stage_gap))
                self.stage_started = now
                self.stage_gap = 0.0
                self.stage = normal
                if self.span is not None:
                    tracing.stage_changed(self.span, normal)
        self.version += 1
        self.last_progress = now

    def raise_if_lost(self, now: float | None = None) -> None:
        """Raise :class:`LeaseLostError` once the lease is lost or may have expired.

        The second test needs no network: the last successful renewal plus the TTL (less
        a margin) has passed on the local monotonic clock, so an owner resumed after
        SIGSTOP, a GC or a VM pause stops before its heartbeat has run again.
        """
        if self.lost_reason is not None:
            raise LeaseLostError(self.task_id, self.token, self.lost_reason)
        if now is None:
            now = time.monotonic()
        if now - self.renewed > self.expiry_window:
            self.mark_lost(EXPIRED_LOCALLY)
            raise LeaseLostError(self.task_id, self.token, self.lost_reason or EXPIRED_LOCALLY)

    def begin_block(self, block: StageDeadline) -> None:
        """A ``deadline()`` or ``stream()`` block begins: its deadlines replace the stage's."""
        self.deadline = block

    def end_block(self) -> None:
        """The block ended: the stage table applies again."""
        self.deadline = None

    # -- the heartbeat's side -------------------------------------------------------------

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

    def renewed_at(self, sent: float, details: Mapping[str, Any] | None = None) -> None:
        """A renewal sent at ``sent`` was accepted; it wrote ``details`` (if given)."""
        self.renewed = sent
        if details is not None:
            self.published_details = details

    def announce_the_end(self) -> bool:
        """The attempt ends: True when Flower knows it and not its last stage or details yet."""
        if not self.announced or (self.stage == self.announced_stage and self.details is self.announced_details):
            return False
        self.announced_stage = self.stage
        self.announced_details = self.details
        return True

    def announce(self) -> bool:
        """Flower is told this attempt's stage and details now; False when it knows them already."""
        details = self.published_details
        if self.announced and self.stage == self.announced_stage and details is self.announced_details:
            return False
        self.announced = True
        self.announced_stage = self.stage
        self.announced_details = details
        return True

    def report(self, now: float) -> tuple[ProgressReport, Mapping[str, Any]]:
        """The progress to publish at ``now``, and the details object it carries.

        The details are encoded only when they changed since the last accepted renewal;
        hand the object to :attr:`published_details` once a renewal wrote them.
        """
        details = self.details  # read first: a progress() call in between is sent next time
        text = encode_details(details) if details is not self.published_details else ""
        age_ms = int((now - self.last_progress) * 1000)
        return ProgressReport(self.stage or "", self.version, age_ms, text), details

    def take_activity(self, *, ended: bool = False) -> tuple[int, list[tuple[str | None, float, float]]]:
        """Progress calls and finished stages since the last call.

        Returns ``(progress calls, [(stage, seconds in it, longest gap), …])``. The longest
        gap is the longest time between two progress calls while the stage was current: what
        its deadline bounds. With ``ended`` (the attempt ends), the current stage is closed too.
        """
        version = self.version
        updates, self.counted_version = version - self.counted_version, version
        finished, self.stage_log = self.stage_log, []
        if ended and self.stage is not None:
            now = _monotonic()
            finished.append((self.stage, now - self.stage_started, max(self.stage_gap, now - self.last_progress)))
            self.stage_started = now
            self.stage_gap = 0.0
        return updates, finished

    def count_activity(self, *, ended: bool = False, duration: float | None = None) -> None:
        """Hand :meth:`take_activity` to this process's metrics (each heartbeat tick, and at the end).

        A lost owner's last gap is its stall, not a sample of how long the stage needs.
        ``duration`` is the run time of an attempt that stored its SUCCESS.
        """
        updates, finished = self.take_activity(ended=ended)
        metrics.buffer.count_activity(updates, finished, sample_gaps=self.lost_reason is None, duration=duration)

    def mark_lost(self, reason: str) -> bool:
        """Mark the lease lost; True the first time (so callers report it once)."""
        with self.lock:
            if self.lost_reason is not None or self.ended:
                return False
            self.lost_reason = reason
            return True

    # -- the end of the lease (either half, under the lock) -----------------------------------

    def end(self) -> bool:
        """A result write ended the lease; True if it had not ended before."""
        with self.lock:
            if self.ended:
                return False
            self.ended = True
            return True

    def stop_serving(self) -> bool:
        """The attempt ends its lease itself; True if it was live (neither ended nor lost)."""
        with self.lock:
            live = not self.ended and self.lost_reason is None
            self.ended = True
            return live

    def refused(self, what: str) -> str:
        """The end the attempt asked for was refused: the lease is lost; the reason."""
        with self.lock:
            self.lost_reason = self.lost_reason or what
            return self.lost_reason

    def mark_retrying(self) -> None:
        """The lease was moved to RETRYING before ``retry()`` sends its message."""
        with self.lock:
            self.retrying = True

    # -- the interrupt (under the lock) ------------------------------------------------------

    def interrupt(self, deliver: Callable[[OwnedLease], bool]) -> str:
        """Interrupt the body: ``"done"`` when it finished, ``"held"`` while a shield runs
        (delivered at its end), else ``deliver(self)`` runs under the lock: ``"sent"``.

        ``deliver`` returns True for an asynchronous exception that the thread raises later:
        :meth:`finish_body` and :meth:`enter_shield` withdraw it if it has not landed.
        """
        with self.lock:
            if self.body_done:
                return "done"
            if self.shield_depth:
                self.interrupt_pending = True
                return "held"
            self.interrupt_sent = deliver(self)
            return "sent"

    def finish_body(self, withdraw: Callable[[OwnedLease], None]) -> None:
        """The body returned or raised: no interrupt lands from now on."""
        with self.lock:
            self.body_done = True
            if self.interrupt_sent:
                self.interrupt_sent = False
                withdraw(self)

    def enter_shield(self, withdraw: Callable[[OwnedLease], None]) -> None:
        """A shielded block begins: an interrupt sent and not landed waits for its end."""
        with self.lock:
            self.shield_depth += 1
            if self.interrupt_sent:
                self.interrupt_sent = False
                self.interrupt_pending = True
                withdraw(self)

    def leave_shield(self) -> bool:
        """A shielded block ends; True when an interrupt held off is due now."""
        with self.lock:
            self.shield_depth -= 1
            due = self.shield_depth == 0 and self.interrupt_pending and not self.body_done
            if due:
                self.interrupt_pending = False
            return due

    def landing(self) -> bool | None:
        """An asynchronous interrupt is about to be raised in the body's greenlet (by the gevent
        hub, the greenlet parked): True to raise it, False when it was withdrawn meanwhile,
        ``None`` while the lock is held (the hub cannot wait for it: try again)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            sent, self.interrupt_sent = self.interrupt_sent, False
            return sent
        finally:
            self.lock.release()

    def signal_landed(self) -> bool:
        """The interrupt's signal handler runs (in the task's thread, the lock not taken):
        True to raise it now, False when the body finished or is shielded (then it waits)."""
        if self.body_done:
            return False
        if self.shield_depth:
            self.interrupt_pending = True
            return False
        return True

    def no_progress_deadline(self, now: float) -> tuple[float, float, str]:
        """Return ``(seconds allowed, seconds without progress, what bounds it)`` at ``now``."""
        block = self.deadline
        if block is None:
            return self.policy.stage_timeout(self.stage), now - self.last_progress, "stage"
        if block.total is not None and now - block.started > block.total:
            return block.total, now - block.started, f"{block.kind} total timeout"
        if block.kind == "stream" and block.chunks == 0:
            return block.first, now - block.started, "first token timeout"
        if block.kind == "stream":
            return block.idle, now - self.last_progress, "idle timeout"
        return block.first, now - block.started, "deadline"
