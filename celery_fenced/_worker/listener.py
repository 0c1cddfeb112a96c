"""What the heartbeat's findings do in a worker: events, signals, reaps, interrupts, failures.

:class:`WorkerListener` is the :class:`~celery_fenced._worker.heartbeat.HeartbeatListener` of a worker
process: a lost lease is reported (``task-lease-lost``, ``lease_lost``) and, where
configured, its body interrupted; a stall is reported; a released lease asks for a reap; an
attempt past ``fenced_max_task_duration`` gets its FAILURE stored; a new stage is published
to Flower.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping

from celery import Celery
from celery import states as celery_states
from celery.app.task import Context
from celery.exceptions import TimeLimitExceeded

from .. import signals as fenced_signals
from .._lease.liveness_store import hostname_of
from .._reaper.reaper import request_reap
from .._task.owner import OwnedLease
from .._telemetry import events, tracing
from .._telemetry.names import NAME_MEMO_LIMIT
from ..conf import nearest
from .attempt import begin
from .interrupt import interrupt

__all__ = ["WorkerListener"]

logger = logging.getLogger("celery_fenced.worker.listener")


class WorkerListener:
    """What the heartbeat's findings do in a worker: signals, interrupts, reaps, failures."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def lost(self, lease: OwnedLease, reason: str) -> None:
        events.send_about(self.app, "task-lease-lost", lease, reason=reason)
        tracing.lease_lost(lease.span, reason)
        self._tell_the_body(lease, reason)

    @staticmethod
    def _tell_the_body(lease: OwnedLease, reason: str) -> None:
        """The ``lease_lost`` signal, then the interrupt where the task asks for one."""
        fenced_signals.lease_lost.send(
            sender=lease.task_name, task_id=lease.task_id, token=lease.token, stage=lease.stage, reason=reason
        )
        if lease.policy.interrupt_on_loss:
            interrupt(lease)

    def stalled(self, lease: OwnedLease, bound: str, allowed: float, elapsed: float) -> None:
        tracing.stalled(lease.span, lease.stage, bound, allowed, elapsed)
        events.send_about(
            self.app,
            "task-stalled",
            lease,
            bound=bound,
            allowed=allowed,
            elapsed=round(elapsed, 3),
            on_stall=lease.policy.on_stall,
        )
        fenced_signals.progress_stalled.send(
            sender=lease.task_name,
            task_id=lease.task_id,
            token=lease.token,
            stage=lease.stage,
            bound=bound,
            allowed=allowed,
            elapsed=elapsed,
            on_stall=lease.policy.on_stall,
        )

    def released(self, lease: OwnedLease) -> None:
        # The reaper thread of this worker's main process, which no task process can block
        # (a control message to this worker from a prefork child), whatever the routing.
        request_reap(self.app, worker=hostname_of(lease.owner_id))

    def duration_exceeded(self, lease: OwnedLease) -> None:
        limit = lease.policy.max_task_duration
        reason = f"max task duration exceeded ({limit:g}s)"
        if not lease.mark_lost(reason):
            return
        logger.error(
            "task %s[%s] ran past fenced_max_task_duration (%ss): FAILURE stored, token=%s",
            lease.task_name,
            lease.task_id,
            limit,
            lease.token,
        )
        request = Context(id=lease.task_id, task=lease.task_name, hostname=socket.gethostname())
        attempt = begin(request, lease)
        failure = TimeLimitExceeded(f"fenced_max_task_duration ({limit:g}s) exceeded")
        try:
            self.app.backend.store_result(lease.task_id, failure, celery_states.FAILURE, request=request)
        except Exception:
            logger.exception("could not store the max-duration FAILURE of task %s", lease.task_id)
        if attempt.write == "stored":
            # The attempt now ends as an Ignore, for which the worker sends no event: without
            # this one, Flower would show the task running for good.
            events.send_about(self.app, "task-failed", lease, exception=repr(failure), traceback="")
            # The call it recorded at acquire: the write ended the lease, which leaves none.
            self.app.backend.ended_without_owner(lease.task_id, lease.call, failure, celery_states.FAILURE)
        self._tell_the_body(lease, reason)

    def renewed(self, leases: list[OwnedLease]) -> None:
        for lease in leases:
            if not lease.announce():
                continue
            details = lease.published_details
            events.send_about(
                self.app,
                "task-progress",
                lease,
                version=lease.version,
                takeovers=lease.takeovers,
                details=dict(details or {}),
            )
            table = lease.policy.stage_timeouts
            if table and lease.stage is not None and lease.stage not in table:
                _log_unknown_stage_once(lease.task_name, lease.stage, table, lease.policy.default_stage_timeout)


# Global: an unknown stage is warned about once per process, whatever the app.
_unknown_stages: set[str] = set()


def _log_unknown_stage_once(task_name: str, stage: str, table: Mapping[str, float], default: float) -> None:
    """Warn once per stage and process about a stage the table does not have (a typo, often)."""
    if stage in _unknown_stages:
        return
    if len(_unknown_stages) >= NAME_MEMO_LIMIT:
        _unknown_stages.clear()  # dynamic stage names: warn again, never grow without bound
    _unknown_stages.add(stage)
    hint = nearest(stage, table)
    logger.warning(
        "task %s: stage %r is not in fenced_stage_timeouts%s; it gets the default deadline (%gs)",
        task_name,
        stage,
        f" (did you mean {hint!r}?)" if hint else "",
        default,
    )
