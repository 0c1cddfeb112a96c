"""``ProgressLeasedTask``: the Celery task base class that holds a progress-aware lease.

::

    @app.task(bind=True, base=ProgressLeasedTask)
    def build_report(self, report_id):
        rows = load(report_id)
        self.progress("LOAD_DATA", rows=len(rows))
        ...

The lease is taken before the body runs (so the STARTED write already carries the token),
renewed by the process's heartbeat while the body reports progress within its stage's
deadline, and ended by the fenced result write. Eager calls run without a lease.

Importing this module loads none of the worker side: an attempt exists only in a worker,
where the lease's life (:mod:`celery_fenced._worker.lifecycle`) is loaded already, and the
task reaches it only through :mod:`~celery_fenced._task.wiring`. The body's API finds the
lease its thread holds (:func:`~celery_fenced._task.running.current_lease`); the rest asks the
request only whether the worker began an attempt for it, and then hands the call to the
worker side.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from types import TracebackType
from typing import Any, ClassVar

from celery import Celery, Task
from celery.exceptions import Ignore

from .._lease.state import Checkpoint, LeaseState
from .._lease.store import is_fenced
from .._telemetry.process import TELEMETRY
from ..conf import ensure_conf, normalise_stage, positive_seconds
from .calls import mark_replacement
from .details import check_details
from .owner import OwnedLease, StageDeadline
from .running import began, thread_state
from .wiring import WORKER_REQUEST, connect_worker_hooks, worker_interrupt, worker_lifecycle

__all__ = ["ProgressLeasedTask", "StageBlock"]


class StageBlock:
    """A ``deadline()`` or ``stream()`` block: its own deadlines replace the stage table inside.

    In a stream, :meth:`chunk` (or iterating :meth:`wrap`) is progress. Outside a worker
    (eager calls) the block only times itself.
    """

    def __init__(
        self,
        lease: OwnedLease | None,
        stage: str,
        *,
        kind: str,
        first: float,
        idle: float,
        total: float | None,
    ) -> None:
        positive_seconds("first_token_timeout", first)
        positive_seconds("idle_timeout", idle)
        positive_seconds("total_timeout", total, allow_none=True)
        self._lease = lease
        self.stage = normalise_stage(stage)
        self.block = StageDeadline(
            stage=self.stage, first=first, idle=idle, total=total, started=time.monotonic(), kind=kind
        )

    @property
    def chunks(self) -> int:
        """Chunks received so far."""
        return self.block.chunks

    @property
    def first_chunk_seconds(self) -> float | None:
        """Seconds from the start of the block to its first chunk, once one came."""
        if self.block.first_chunk_at is None:
            return None
        return self.block.first_chunk_at - self.block.started

    def __enter__(self) -> StageBlock:
        self.block.started = time.monotonic()
        if self._lease is not None:
            self._lease.progress(self.stage)
            self._lease.body.begin_block(self.block)
        return self

    def chunk(self) -> None:
        """Record one real chunk of a streamed response: progress."""
        if self.block.first_chunk_at is None:
            self.block.first_chunk_at = time.monotonic()
            if self.block.kind == "stream":
                TELEMETRY.metrics.observe(
                    "owner_ai_first_token_duration_seconds", self.block.first_chunk_at - self.block.started
                )
        self.block.chunks += 1
        if self._lease is not None:
            self._lease.progress()

    def wrap(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield each item of ``iterable``, recording each as a chunk."""
        for item in iterable:
            self.chunk()
            yield item

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._lease is not None:
            self._lease.body.end_block()
            if exc_type is None:
                self._lease.progress()


class ProgressLeasedTask(Task):
    """A task whose lease is renewed only while its body makes progress.

    Options below may be set as class attributes or in the ``@app.task(...)`` decorator;
    ``None`` inherits the app's ``fenced_*`` setting of the same name.
    """

    #: Lease length, seconds (``fenced_lease_ttl``).
    lease_ttl: float | None = None
    #: Renew/check period, seconds; must be below ``lease_ttl / 2`` (``fenced_heartbeat_interval``).
    heartbeat_interval: float | None = None
    #: ``maxNoProgress`` per stage, seconds (``fenced_stage_timeouts``).
    stage_timeouts: dict[str, float] | None = None
    #: ``maxNoProgress`` of stages not in the table (``fenced_default_stage_timeout``).
    default_stage_timeout: float | None = None
    #: Failed progress checks in a row before ``on_stall`` applies (``fenced_stall_checks``).
    stall_checks: int | None = None
    #: ``"release"``, ``"expire"`` or ``"alert"`` (``fenced_on_stall``).
    on_stall: str | None = None
    #: Re-enqueues of one task id before it is ABANDONED (``fenced_max_takeovers``).
    max_takeovers: int | None = None
    #: Wall-clock bound of one attempt, seconds (``fenced_max_task_duration``).
    max_task_duration: float | None = None
    #: Interrupt the body when the lease is lost (``fenced_interrupt_on_loss``).
    interrupt_on_loss: bool | None = None

    #: Marks the class for the worker hooks (they do not import this module).
    fenced_task: ClassVar[bool] = True

    #: The worker's request class: its main-process writes name the owner's process.
    Request = WORKER_REQUEST

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        """Connect the worker hooks of ``app`` when a fenced task is bound to it."""
        super().on_bound(app)
        connect_worker_hooks(app)

    # -- the lease of the running attempt ---------------------------------------------------

    def _owned(self) -> OwnedLease | None:
        """The lease of this task's attempt the calling thread runs; ``None`` for an eager or
        direct call (no lease), one made inside a leased body of the same task included."""
        lease = thread_state.lease
        if lease is not None and lease.task_name == self.name and lease.task_id == self.request.id:
            return lease
        self._check_running()
        return None

    def _check_running(self) -> None:
        if self.request_stack.top is None:
            raise RuntimeError(
                f"{self.name}: progress(), stream(), deadline() and the lease exist only "
                "while the task runs (called outside a running task)"
            )

    def progress(self, stage: str | None = None, **details: Any) -> None:
        """Record real progress of the body: sets the stage (when given) and moves its version.

        In memory only: the heartbeat publishes it with its next renewal. ``details`` values
        must be JSON values (str, int, float, bool, None, and lists and dicts of them), within
        ``fenced_max_detail_bytes`` in all; the latest details given are published as the
        lease's ``details`` and handed to the next owner as :attr:`checkpoint`.

        Raises:
            LeaseLostError: the lease is lost (taken over, fenced, released for stalling,
                cancelled), or no renewal succeeded within the lease TTL.
            TypeError: a detail value JSON cannot hold.
            ValueError: a float JSON cannot hold (NaN, infinity), or details whose JSON is
                larger than ``fenced_max_detail_bytes``.
        """
        lease = thread_state.lease  # a thread-local read (self._owned(), inlined: the hot path)
        if lease is None or lease.task_name != self.name:
            self._check_running()
            lease = None
        if lease is None:  # eager or direct call: no lease, only check the arguments
            if details:
                check_details(details, ensure_conf(self.app).policy.max_detail_bytes)
            if stage is not None:
                normalise_stage(stage)
            return
        lease.progress(stage, details)

    def stream(
        self,
        stage: str,
        first_token_timeout: float,
        idle_timeout: float,
        total_timeout: float | None = None,
    ) -> StageBlock:
        """A block around a streamed downstream call; each ``chunk()`` is progress.

        The three deadlines are enforced separately by the heartbeat: time to the first
        chunk, time between chunks, and the whole block.
        """
        return StageBlock(
            self._owned(),
            stage,
            kind="stream",
            first=first_token_timeout,
            idle=idle_timeout,
            total=total_timeout,
        )

    def deadline(self, stage: str, seconds: float) -> StageBlock:
        """A block around one blocking call that reports no progress: one hard deadline."""
        return StageBlock(self._owned(), stage, kind="deadline", first=seconds, idle=seconds, total=seconds)

    @property
    def fencing_token(self) -> int:
        """The fencing token of the running attempt (0 when running without a lease)."""
        lease = self._owned()
        return lease.token if lease is not None else 0

    @property
    def checkpoint(self) -> Checkpoint | None:
        """Where to resume: the last progress an earlier owner of this task id published.

        Given to a takeover (after a stall, a kill, a lost worker) and to a retry, with the
        acquire (no extra round trip); ``None`` on a first attempt, when no earlier owner
        published progress, and when running without a lease (eager calls). It is published
        at the heartbeat's pace, so it may be up to one ``heartbeat_interval`` older than the
        earlier owner's last ``progress()``: resume from it with idempotent steps.
        """
        lease = self._owned()
        return lease.checkpoint if lease is not None else None

    @property
    def lease(self) -> LeaseState | None:
        """A fresh snapshot of this task's shared lease state (one Redis read)."""
        task_id = self.request.id
        if not task_id or not is_fenced(self.app):
            return None
        state: LeaseState | None = self.backend.lease_store.read(task_id)
        return state

    def idempotency_key(self, step: str) -> str:
        """A key stable across takeovers of the same task id: ``"{task_id}:{step}"``."""
        if not isinstance(step, str) or not step:
            raise ValueError(f"step must be a non-empty string, got {step!r}")
        return f"{self.request.id}:{step}"

    # -- the body ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if not began(request):  # eager or direct call: no lease
            return super().__call__(*args, **kwargs)
        return worker_lifecycle().run_body(self, request, super().__call__, args, kwargs)

    def shield(self) -> contextlib.AbstractContextManager[None]:
        """A block the lease-lost interrupt must not cut: it waits for the block's end.

        Use it around a write that must not stop half-way (a transaction's commit, a file
        rename). The lease can still be lost inside: ``progress()`` raises
        :class:`~celery_fenced.exceptions.LeaseLostError` as anywhere, a fenced write of a
        lost owner is still refused, and once the block ends the interrupt
        (:class:`~celery_fenced.exceptions.LeaseInterrupted`) is raised. Keep it short: the
        process stays held while it runs. Outside a worker (eager calls) it does nothing.
        """
        lease = self._owned()
        if lease is None:
            return contextlib.nullcontext()
        block: contextlib.AbstractContextManager[None] = worker_interrupt().shielded(lease)
        return block

    def on_replace(self, sig: Any) -> Any:
        """Celery's ``on_replace()``: the lease passes to the replacement before it is sent.

        The replacement runs under the same task id; it starts afresh (a fenced one takes a
        new, higher token). The hand-off is fenced: an owner that lost its lease sends
        nothing. The replacement's message names the token it was handed off from, so a
        later copy of this task's own message does not run.
        """
        request = self.request
        lease = self._owned()
        if lease is None or request.is_eager:
            return super().on_replace(sig)
        mark_replacement(sig, lease.task_id, lease.publish_id, lease.token)
        worker_lifecycle().hand_off(self, lease, sig)
        try:
            return super().on_replace(sig)
        except Ignore:  # sent: Celery ends the body with Ignore
            worker_lifecycle().replacement_sent(self, lease)
            raise
        except BaseException as exc:
            # Not sent (or not known to be): the error is the task's, stored by its owner. A
            # BaseException too: gevent's hard time limit, an interrupt, SystemExit.
            worker_lifecycle().hand_back(self, lease, exc)
            raise

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Any = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's ``retry()``; the lease waits for the retry message until its eta.

        Where Celery will send the retry message, the lease is moved to RETRYING first, so
        the message (same task id) acquires at once, however short its countdown.
        """
        if countdown is not None:
            delay = float(countdown)
        elif eta is not None:
            delay = max(0.0, eta.timestamp() - time.time())
        else:
            delay = float(self.default_retry_delay or 0)
        request = self.request
        if began(request):
            limit = self.max_retries if max_retries is None else max_retries
            worker_lifecycle().retry_called(self, request, delay, limit, args, kwargs, options)
        return super().retry(
            args=args,
            kwargs=kwargs,
            exc=exc,
            throw=throw,
            eta=eta,
            countdown=countdown,
            max_retries=max_retries,
            **options,
        )
