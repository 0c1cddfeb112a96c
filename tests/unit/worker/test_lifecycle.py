"""The heartbeat of a worker process: one per app and process, never inherited through fork."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_fenced.worker.lifecycle import heartbeat_for, stop_heartbeats


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("heartbeats", set_as_current=False)
    yield app
    stop_heartbeats()
    app.close()


def test_one_heartbeat_per_app_in_a_process(app: Celery) -> None:
    other = Celery("other", set_as_current=False)
    assert heartbeat_for(app, create=False) is None
    first = heartbeat_for(app)
    assert first is not None
    assert heartbeat_for(app) is first
    assert heartbeat_for(other) is not first
    other.close()


def test_a_forked_child_makes_its_own_heartbeat(app: Celery) -> None:
    parent = heartbeat_for(app)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, as a prefork pool process starts
        try:
            inherited = heartbeat_for(app, create=False)
            own = heartbeat_for(app)
            os.write(write, b"own" if inherited is None and own is not None and own is not parent else b"inherited")
        finally:
            os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 64)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert answer == b"own"
    assert heartbeat_for(app) is parent  # the parent keeps its own
