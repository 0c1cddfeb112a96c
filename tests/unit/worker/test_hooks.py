"""The worker's side of Celery's signals and bootsteps (_worker/hooks.py); how a fenced task wires
them to an app is tested with the wiring (tests/unit/task/test_wiring.py)."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from celery_fenced import ProgressLeasedTask
from celery_fenced._reaper.reaper import REAP_TASK_NAME
from celery_fenced._worker import hooks
from celery_fenced._worker.attempt import attempt_of
from celery_fenced._worker.lifecycle import heartbeat_for
from celery_fenced._worker.runtime import runtime_of
from celery_fenced.exceptions import ConfigurationError


def test_the_reapers_own_runs_leave_no_received_or_succeeded_line() -> None:
    hooks.quiet_reaper_runs()
    hooks.quiet_reaper_runs()  # idempotent: one filter
    target = logging.getLogger("celery.app.trace")
    assert target.filters.count(hooks._QUIET) == 1

    def line(name: str, level: int = logging.INFO) -> logging.LogRecord:
        record = logging.LogRecord("celery.app.trace", level, __file__, 1, "Task %(name)s", None, None)
        record.args = {"name": name}
        return record

    assert not hooks._QUIET.filter(line(REAP_TASK_NAME))
    assert hooks._QUIET.filter(line("proj.report"))
    assert hooks._QUIET.filter(line(REAP_TASK_NAME, logging.ERROR))  # its failures are still logged


def test_prerun_takes_the_lease_and_postrun_ends_it(fenced_app: Celery) -> None:
    @fenced_app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def report(self: Any) -> None: ...

    report.push_request(id="h1", hostname="w1@host", delivery_info={"is_eager": False})
    try:
        hooks.on_task_prerun(report, "h1", report.request)
        attempt = attempt_of(report.request)
        assert attempt is not None and attempt.lease is not None and attempt.lease.token > 0
        store = fenced_app.backend.lease_store
        assert store.read("h1").status == "RUNNING"  # type: ignore[union-attr]
        hooks.on_task_postrun(report, "SUCCESS", report.request)
        assert store.read("h1").status == "DONE"  # type: ignore[union-attr]
        heartbeat = heartbeat_for(fenced_app, create=False)
        assert heartbeat is not None and attempt.lease not in heartbeat.leases()
    finally:
        report.pop_request()
        runtime = runtime_of(fenced_app, create=False)
        if runtime is not None:
            runtime.stop()


def test_prerun_of_a_task_whose_options_cannot_work_makes_the_body_raise(fenced_app: Celery) -> None:
    @fenced_app.task(bind=True, base=ProgressLeasedTask, shared=False, on_stall="explode")
    def report(self: Any) -> None: ...

    report.push_request(id="h2", hostname="w1@host", delivery_info={"is_eager": False})
    try:
        hooks.on_task_prerun(report, "h2", report.request)
        attempt = attempt_of(report.request)
        assert isinstance(attempt.error, ConfigurationError)  # type: ignore[union-attr]
        assert "on_stall" in str(attempt.error)  # type: ignore[union-attr]
    finally:
        report.pop_request()


def test_the_start_of_a_shutdown_tells_every_heartbeat_of_the_worker(fenced_app: Celery) -> None:
    from celery import signals

    from celery_fenced._worker.process import WORKER_PROCESS

    @fenced_app.task(bind=True, base=ProgressLeasedTask, shared=False)
    def report(self: Any) -> None: ...

    try:
        assert not WORKER_PROCESS.stopping.is_set()
        # Sent by Celery's SIGTERM handler in the worker's main process.
        signals.worker_shutting_down.send(sender="w1@host", sig="SIGTERM", how="Warm", exitcode=0)
        assert WORKER_PROCESS.stopping.is_set()
    finally:
        WORKER_PROCESS.stopping.clear()
