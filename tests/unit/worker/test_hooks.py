"""The worker's side of Celery's signals and bootsteps (worker/hooks.py), and their wiring."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.concurrency.gevent import TaskPool as GeventPool
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from celery.concurrency.thread import TaskPool as ThreadsPool
from kombu.utils.imports import symbol_by_name

from celery_fenced import ProgressLeasedTask
from celery_fenced.exceptions import ConfigurationError
from celery_fenced.reaper import REAP_TASK_NAME
from celery_fenced.running import attempt_of
from celery_fenced.worker import hooks
from celery_fenced.worker.lifecycle import heartbeat_for
from celery_fenced.worker.runtime import runtime_of
from tests.support.redis_server import RedisServer


class EventletPool:  # named as Celery's, by module: the check reads the pool class's module
    __module__ = "celery.concurrency.eventlet"


def test_the_pool_kind_is_read_from_the_pool_class() -> None:
    assert [hooks.pool_kind_of(pool) for pool in (PreforkPool, ThreadsPool, SoloPool, GeventPool, EventletPool)] == [
        "prefork",
        "threads",
        "solo",
        "gevent",
        "eventlet",
    ]


def test_a_worker_with_fenced_tasks_and_another_backend_is_refused_naming_it() -> None:
    app = Celery("plain", set_as_current=False, backend="redis://127.0.0.1:1/0")

    @app.task(base=ProgressLeasedTask, shared=False)
    def report() -> None: ...

    app.finalize()
    with pytest.raises(ConfigurationError, match="RedisBackend"):
        hooks.check_worker(app, PreforkPool)


def test_the_eventlet_pool_is_refused_in_one_line_saying_why(fenced_app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="does not support the eventlet pool: eventlet is in maintenance"):
        hooks.check_worker(fenced_app, EventletPool)


def test_disabled_prefetch_on_celery_56s_gevent_pool_is_refused_in_one_line(
    fenced_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hooks, "GEVENT_POOL_CANNOT_DISABLE_PREFETCH", True)  # Celery 5.6's fact
    fenced_app.conf.worker_disable_prefetch = True
    with pytest.raises(ConfigurationError, match=r"worker_disable_prefetch on Celery 5\.6's gevent pool takes no"):
        hooks.check_worker(fenced_app, GeventPool)
    fenced_app.conf.worker_disable_prefetch = False
    with pytest.raises(ConfigurationError, match="monkey patching"):  # past that check, to the next
        hooks.check_worker(fenced_app, GeventPool)


def test_a_gevent_pool_in_a_process_gevent_did_not_patch_is_refused(fenced_app: Celery) -> None:
    # This test process is not monkey-patched, as a worker started by app.worker_main() is not.
    with pytest.raises(ConfigurationError, match=r"needs gevent.s monkey patching.*celery -A proj worker -P gevent"):
        hooks.check_worker(fenced_app, GeventPool)


def test_a_task_whose_options_cannot_work_stops_the_worker_at_its_start(fenced_app: Celery) -> None:
    @fenced_app.task(base=ProgressLeasedTask, shared=False, lease_ttl=2, heartbeat_interval=5)
    def report() -> None: ...

    with pytest.raises(ConfigurationError, match="heartbeat_interval"):
        hooks.check_worker(fenced_app, PreforkPool)


def test_binding_a_fenced_task_wires_the_worker_by_name(fenced_app: Celery) -> None:
    @fenced_app.task(base=ProgressLeasedTask, shared=False)
    def report() -> None: ...

    fenced_app.finalize()  # binds the task: its on_bound wires the app
    named = {step for step in fenced_app.steps["worker"] | fenced_app.steps["consumer"] if isinstance(step, str)}
    assert {symbol_by_name(step) for step in named} == {
        hooks.FencedWorkerStep,
        hooks.ChildExitWatch,
        hooks.ReconnectWatch,
    }
    assert REAP_TASK_NAME in fenced_app.tasks


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


@pytest.fixture
def evicting(redis_server: RedisServer) -> Iterator[None]:
    with redis_server.client() as client:
        client.config_set("maxmemory-policy", "allkeys-lru")
        yield
        client.config_set("maxmemory-policy", "noeviction")


def test_a_redis_that_may_evict_leases_is_warned_about_once(
    fenced_app: Celery, evicting: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=hooks.__name__):
        hooks.warn_if_redis_can_evict(fenced_app)
        hooks.warn_if_redis_can_evict(fenced_app)
    assert caplog.text.count("maxmemory-policy=allkeys-lru") == 1


def test_an_unreachable_lease_redis_is_said_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("down", set_as_current=False, backend="fenced+redis://127.0.0.1:1/0")
    app.conf.redis_socket_connect_timeout = 1
    with caplog.at_level(logging.ERROR, logger=hooks.__name__):
        assert not hooks.lease_redis_reachable(app)
    assert "cannot be reached" in caplog.text and "127.0.0.1:1" in caplog.text


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
