"""The worker's checks at its start (worker/checks.py): what cannot work is refused in one line."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from celery import Celery
from celery.concurrency.gevent import TaskPool as GeventPool
from celery.concurrency.prefork import TaskPool as PreforkPool
from celery.concurrency.solo import TaskPool as SoloPool
from celery.concurrency.thread import TaskPool as ThreadsPool

from celery_fenced import ProgressLeasedTask
from celery_fenced._worker import checks
from celery_fenced.exceptions import ConfigurationError
from tests.support.redis_server import RedisServer


class EventletPool:  # named as Celery's, by module: the check reads the pool class's module
    __module__ = "celery.concurrency.eventlet"


def test_the_pool_kind_is_read_from_the_pool_class() -> None:
    assert [checks.pool_kind_of(pool) for pool in (PreforkPool, ThreadsPool, SoloPool, GeventPool, EventletPool)] == [
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
        checks.check_worker(app, PreforkPool)


def test_the_eventlet_pool_is_refused_in_one_line_saying_why(fenced_app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="does not support the eventlet pool: eventlet is in maintenance"):
        checks.check_worker(fenced_app, EventletPool)


def test_disabled_prefetch_on_celery_56s_gevent_pool_is_refused_in_one_line(
    fenced_app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checks, "GEVENT_POOL_CANNOT_DISABLE_PREFETCH", True)  # Celery 5.6's fact
    fenced_app.conf.worker_disable_prefetch = True
    with pytest.raises(ConfigurationError, match=r"worker_disable_prefetch on Celery 5\.6's gevent pool takes no"):
        checks.check_worker(fenced_app, GeventPool)
    fenced_app.conf.worker_disable_prefetch = False
    with pytest.raises(ConfigurationError, match="monkey patching"):  # past that check, to the next
        checks.check_worker(fenced_app, GeventPool)


def test_a_gevent_pool_in_a_process_gevent_did_not_patch_is_refused(fenced_app: Celery) -> None:
    # This test process is not monkey-patched, as a worker started by app.worker_main() is not.
    with pytest.raises(ConfigurationError, match=r"needs gevent.s monkey patching.*celery -A proj worker -P gevent"):
        checks.check_worker(fenced_app, GeventPool)


def test_a_task_whose_options_cannot_work_stops_the_worker_at_its_start(fenced_app: Celery) -> None:
    @fenced_app.task(base=ProgressLeasedTask, shared=False, lease_ttl=2, heartbeat_interval=5)
    def report() -> None: ...

    with pytest.raises(ConfigurationError, match="heartbeat_interval"):
        checks.check_worker(fenced_app, PreforkPool)


@pytest.fixture
def evicting(redis_server: RedisServer) -> Iterator[None]:
    with redis_server.client() as client:
        client.config_set("maxmemory-policy", "allkeys-lru")
        yield
        client.config_set("maxmemory-policy", "noeviction")


def test_a_redis_that_may_evict_leases_is_warned_about_once(
    fenced_app: Celery, evicting: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=checks.logger.name):
        checks.warn_if_redis_can_evict(fenced_app)
        checks.warn_if_redis_can_evict(fenced_app)
    assert caplog.text.count("maxmemory-policy=allkeys-lru") == 1


def test_an_unreachable_lease_redis_is_said_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    app = Celery("down", set_as_current=False, backend="fenced+redis://127.0.0.1:1/0")
    app.conf.redis_socket_connect_timeout = 1
    with caplog.at_level(logging.ERROR, logger=checks.logger.name):
        assert not checks.lease_redis_reachable(app)
    assert "cannot be reached" in caplog.text and "127.0.0.1:1" in caplog.text
