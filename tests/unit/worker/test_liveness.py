"""The liveness record of a worker's main process: written at start, renewed while it runs,
removed at a warm shutdown; a record nobody renews lapses, and the reaper says so."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_fenced._reaper.reaper import reap
from celery_fenced._worker.liveness import LivenessRecord
from tests.support.processes import wait_until
from tests.support.redis_server import RedisServer


@pytest.fixture
def app(redis_server: RedisServer) -> Iterator[Celery]:
    redis_server.client(13).flushdb()
    app = Celery("liveness", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="fenced+" + redis_server.url(13),
        fenced_lease_ttl=1,
        fenced_heartbeat_interval=0.1,
    )
    yield app
    app.backend.client.connection_pool.disconnect()
    app.close()


def alive_until(app: Celery, hostname: str) -> float | None:
    store = app.backend.lease_store
    return store.client.zscore(store.keys.workers, hostname)  # type: ignore[no-any-return]


def test_the_record_is_written_at_start_renewed_and_removed_at_shutdown(app: Celery) -> None:
    record = LivenessRecord(app, "w1@host")
    record.start()
    first = alive_until(app, "w1@host")
    assert first is not None
    wait_until(lambda: (alive_until(app, "w1@host") or 0) > first and record.renewals >= 3, 5, "renewals")
    record.stop()
    assert alive_until(app, "w1@host") is None


def test_a_record_nobody_renews_lapses_and_the_reaper_says_so(app: Celery, caplog: pytest.LogCaptureFixture) -> None:
    LivenessRecord(app, "dead@host").renew()  # one renewal, then the process is gone
    with caplog.at_level(logging.WARNING, logger="celery_fenced.reaper"):
        wait_until(lambda: reap(app) is not None and alive_until(app, "dead@host") is None, 5, "the record to lapse")
    assert "worker dead@host is gone (its liveness record lapsed)" in caplog.text
