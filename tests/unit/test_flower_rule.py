"""The token rule of the Flower integration, on Celery's own event state (what Flower keeps)."""

from __future__ import annotations

import time
from typing import Any

from celery import states
from celery.events.state import State

from celery_fenced.contrib.flower import install


def event(kind: str, **fields: Any) -> dict[str, Any]:
    return {
        "type": kind,
        "uuid": "t1",
        "hostname": "w1@host",
        "timestamp": time.time(),
        "local_received": time.time(),
        "clock": 1,
        **fields,
    }


def state_of(*events: dict[str, Any]) -> Any:
    install()
    state = State()
    for one in events:
        state.event(one)
    return state.tasks["t1"]


def test_progress_shows_stage_token_and_attempt_and_keeps_the_task_started() -> None:
    task = state_of(
        event("task-received", name="proj.report", args="()", kwargs="{}"),
        event("task-started", pid=42),
        event("task-progress", token=3, stage="load-data", attempt=1, takeovers=0),
    )
    assert task.state == states.STARTED
    assert (task.token, task.stage, task.attempt) == (3, "load-data", 1)


def test_an_event_of_an_older_token_is_never_applied() -> None:
    task = state_of(
        event("task-received", name="proj.report", args="()", kwargs="{}"),
        event("task-progress", token=3, stage="load-data", attempt=1),
        event("task-takeover", token=3, cause="stalled"),
        event("task-progress", token=4, stage="load-data", attempt=2, takeovers=1),
        event("task-succeeded", token=3, result="'zombie'", runtime=1.0),  # the old owner wakes
    )
    assert task.state == states.STARTED and task.token == 4 and task.attempt == 2
    assert task.result != "'zombie'"


def test_progress_after_a_stall_shows_the_task_running_again() -> None:
    install()
    state = State()
    state.event(event("task-progress", token=3, stage="call-ai", attempt=1))
    state.event(event("task-stalled", token=3, stage="call-ai"))
    assert state.tasks["t1"].state == "STALLED"
    state.event(event("task-progress", token=3, stage="save", attempt=1))
    assert state.tasks["t1"].state == states.STARTED and state.tasks["t1"].stage == "save"


def test_the_first_news_of_a_task_may_be_its_progress() -> None:
    task = state_of(event("task-progress", token=1, stage="load-data", attempt=1))
    assert task.state == states.STARTED and task.worker is not None


def test_progress_details_show_as_json_and_a_stale_owners_never_replace_them() -> None:
    task = state_of(
        event("task-received", name="proj.report", args="()", kwargs="{}"),
        event("task-progress", token=3, stage="process", attempt=1, details={"done": 6}),
        event("task-progress", token=4, stage="process", attempt=2, details={"done": 8, "note": "é"}),
        event("task-progress", token=3, stage="process", attempt=1, details={"done": 99}),  # the zombie
    )
    assert task.details == {"done": 8, "note": "é"}
    assert str(task.details) == '{"done": 8, "note": "é"}'  # what the task page prints
    assert task.as_dict()["details"] == {"done": 8, "note": "é"}  # what /api/task/info returns
