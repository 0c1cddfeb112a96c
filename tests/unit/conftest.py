"""Fixtures of the unit tests: an app with the fenced backend on the session's private Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu.utils import json

from tests.support.redis_server import RedisServer

BROKER_DB, BACKEND_DB = 12, 13


@pytest.fixture
def fenced_app(redis_server: RedisServer) -> Iterator[Celery]:
    """An app whose broker and fenced result backend are empty databases of the private Redis."""
    for db in (BROKER_DB, BACKEND_DB):
        redis_server.client(db).flushdb()
    app = Celery("unit", set_as_current=False)
    app.conf.update(
        broker_url=redis_server.url(BROKER_DB),
        result_backend="fenced+" + redis_server.url(BACKEND_DB),
        fenced_requeue_timeout=60,
        fenced_takeover_grace=0,
    )
    yield app
    if "lease_store" in app.backend.__dict__:
        app.backend.lease_store.close()
    app.backend.client.close()
    app.close()


def queued(app: Celery, queue: str = "celery") -> list[dict[str, Any]]:
    """The messages waiting in ``queue`` of ``app``'s Redis broker, oldest first."""
    with app.connection_for_write() as connection:
        raw = connection.default_channel.client.lrange(queue, 0, -1)
    return [json.loads(message) for message in reversed(raw)]
