"""Task events (events.py): sent to a real receiver when on, nothing when off, one dispatcher per process."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_fenced._celery.apps import record_of
from celery_fenced._task.owner import OwnedLease
from celery_fenced._telemetry import events
from celery_fenced._telemetry.process import TELEMETRY
from celery_fenced.conf import FencedConfig


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Iterator[Celery]:
    monkeypatch.setattr(TELEMETRY, "events_enabled", None)
    monkeypatch.setattr(TELEMETRY, "events_hostname", None)
    app = Celery("events", broker="memory://", set_as_current=False)
    yield app
    app.close()


def received(app: Celery, send: Any) -> list[dict[str, Any]]:
    """Run ``send()`` while a real event receiver listens; what it got."""
    got: list[dict[str, Any]] = []
    ready = threading.Event()
    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": got.append})
        receiver.on_consume_ready = lambda *args, **kwargs: ready.set()  # bound: it may be sent to now
        listening = threading.Thread(target=receiver.capture, kwargs={"limit": 1, "timeout": 10, "wakeup": False})
        listening.start()
        assert ready.wait(10)
        send()
        listening.join(15)
    return got


def lease() -> OwnedLease:
    policy = FencedConfig.from_mapping({}).policy
    owned = OwnedLease("t1", "proj.report", "host/1/a", 7, 2, 1, policy)
    owned.progress("load-data")
    return owned


def test_an_event_about_a_lease_reaches_a_receiver(app: Celery) -> None:
    events.configure(enabled=True, hostname="w1@host")
    got = received(app, lambda: events.send_about(app, "task-progress", lease(), version=3, details={"rows": 5}))
    (event,) = got
    assert event["type"] == "task-progress" and event["uuid"] == "t1" and event["hostname"] == "w1@host"
    assert (event["token"], event["stage"], event["attempt"], event["name"]) == (7, "load-data", 2, "proj.report")
    assert event["version"] == 3 and event["details"] == {"rows": 5}


def test_nothing_is_sent_or_built_when_events_are_off(app: Celery) -> None:
    events.configure(enabled=False)
    assert not events.enabled(app)
    assert events.send(app, "task-stalled", task_id="t1", token=1, stage=None, attempt=1) is False
    assert record_of(app).dispatcher is None


def test_the_apps_setting_decides_when_the_worker_said_nothing(app: Celery) -> None:
    assert not events.enabled(app)
    app.conf.worker_send_task_events = True
    assert events.enabled(app)


def test_an_unknown_event_type_is_refused(app: Celery) -> None:
    with pytest.raises(ValueError, match="task-finished"):
        events.send(app, "task-finished", task_id="t1", token=1, stage=None, attempt=1)


def test_the_dispatcher_is_the_processes_own_and_kept_in_the_apps_record(app: Celery) -> None:
    events.configure(enabled=True)
    assert events.send(app, "task-stalled", task_id="t1", token=1, stage="s", attempt=1)
    pid, dispatcher = record_of(app).dispatcher  # type: ignore[misc]
    assert pid == os.getpid()
    assert events.send(app, "task-stalled", task_id="t1", token=1, stage="s", attempt=1)
    assert record_of(app).dispatcher[1] is dispatcher  # type: ignore[index]
    record_of(app).dispatcher = (pid + 1, dispatcher)  # as a forked child finds its parent's
    assert events.send(app, "task-stalled", task_id="t1", token=1, stage="s", attempt=1)
    assert record_of(app).dispatcher[0] == pid and record_of(app).dispatcher[1] is not dispatcher  # type: ignore[index]


def test_a_failed_send_drops_the_event_and_the_dispatcher_not_the_task(app: Celery) -> None:
    events.configure(enabled=True)
    broken = Celery("broken", broker="redis://127.0.0.1:1/0", set_as_current=False)
    broken.conf.broker_connection_retry = False
    broken.conf.broker_connection_max_retries = 0
    broken.conf.broker_transport_options = {"max_retries": 0}
    assert events.send(broken, "task-stalled", task_id="t1", token=1, stage="s", attempt=1) is False
    assert record_of(broken).dispatcher is None
    broken.close()
