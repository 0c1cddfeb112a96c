"""The token rule of the Flower integration, on Celery's own event state (what Flower keeps)."""

from __future__ import annotations

import time
from typing import Any

from celery import states
from celery.events.state import State

from celery_fenced.contrib.flower import attempts_table, install


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


def at(seconds: float, kind: str, **fields: Any) -> dict[str, Any]:
    return dict(event(kind, **fields), timestamp=1_700_000_000 + seconds)


def test_a_zombie_takeover_shows_both_attempts_and_the_refused_write() -> None:
    task = state_of(
        at(0, "task-received", name="proj.report", args="()", kwargs="{}"),
        at(0.1, "task-started", pid=41),
        at(0.6, "task-progress", token=1, stage="load-data", attempt=1),
        at(3.0, "task-stalled", token=1, stage="load-data", bound="stage"),
        at(3.0, "task-lease-lost", token=1, stage="load-data", reason="stalled: no progress within the stage (2s)"),
        at(3.1, "task-takeover", token=1, stage="load-data", attempt=1, cause="stalled", hostname="w3@host"),
        at(3.2, "task-started", pid=52, hostname="w2@host"),
        at(3.3, "task-progress", token=3, stage="", attempt=2, takeovers=1, hostname="w2@host"),
        at(3.4, "task-progress", token=3, stage="persist-result", attempt=2, takeovers=1, hostname="w2@host"),
        at(3.5, "task-succeeded", result="'owner 3'", runtime=0.2, hostname="w2@host"),
        at(9.0, "task-fenced", token=1, stage="persist-result", attempt=1, current_token=3, state="SUCCESS"),
    )
    assert task.state == states.SUCCESS and task.worker.hostname == "w2@host" and task.stage == "persist-result"
    first, second = task.attempts
    assert first == {
        "attempt": 1,
        "token": 1,
        "worker": "w1@host",
        "started": 1_700_000_000.1,
        "ended": 1_700_000_003.0,
        "stage": "persist-result",
        "outcome": "write-refused",
        "reason": "SUCCESS refused: token 1, current 3",
    }
    assert second == {
        "attempt": 2,
        "token": 3,
        "worker": "w2@host",
        "started": 1_700_000_003.2,
        "ended": 1_700_000_003.5,
        "stage": "persist-result",
        "outcome": "succeeded",
        "reason": None,
    }
    assert task.as_dict()["attempts"] == [first, second]  # what /api/task/info returns


def test_a_stalled_task_waits_as_stalled_then_shows_the_takeover_until_the_new_owner_runs() -> None:
    install()
    state = State()
    state.event(at(0, "task-started", pid=41))
    state.event(at(1, "task-progress", token=1, stage="call-ai", attempt=1))
    state.event(at(3, "task-stalled", token=1, stage="call-ai", bound="stage"))
    state.event(at(3, "task-lease-lost", token=1, stage="call-ai", reason="stalled"))
    assert state.tasks["t1"].state == "STALLED"
    state.event(at(4, "task-takeover", token=1, attempt=1, cause="stalled", hostname="w3@host"))
    assert state.tasks["t1"].state == "TAKEOVER" and state.tasks["t1"].worker.hostname == "w1@host"
    state.event(at(5, "task-progress", token=2, stage="call-ai", attempt=2, hostname="w2@host"))
    assert state.tasks["t1"].state == states.STARTED
    assert [a["outcome"] for a in state.tasks["t1"].attempts] == ["lease-lost", "running"]


def test_a_cancelled_task_shows_revoked() -> None:
    task = state_of(
        at(0, "task-started", pid=41),
        at(1, "task-progress", token=1, stage="load-data", attempt=1),
        at(2, "task-lease-lost", token=1, reason="renewal refused: cancelled (celery fenced cancel)"),
    )
    assert task.state == states.REVOKED
    assert task.attempts[0]["outcome"] == "cancelled"


def test_abandon_redrive_and_cancel_show_what_the_backend_stores_at_once() -> None:
    """Celery's order of states keeps a FAILURE against every later event but a SUCCESS, and a
    REVOKED below it: the operator's and the reaper's events move the task all the same."""
    install()
    state = State()
    state.event(at(0, "task-started", pid=41))
    state.event(at(1, "task-progress", token=5, stage="load-data", attempt=1))
    state.event(at(3, "task-abandoned", token=5, attempt=1, cause="stalled", hostname="celery@reaper"))
    task = state.tasks["t1"]
    assert task.state == states.FAILURE and "TaskAbandonedError" in task.exception
    state.event(at(3.5, "task-succeeded", result="'zombie'", runtime=3.0))  # its late news: refused, stored nothing
    assert task.state == states.FAILURE
    state.event(at(4, "task-takeover", token=5, attempt=1, cause="redrive", hostname="celery@ops"))
    assert (task.state, task.exception, task.worker.hostname) == ("TAKEOVER", None, "w1@host")
    state.event(at(5, "task-takeover", token=5, attempt=1, cause="stalled", hostname="w3@host"))  # the re-send
    state.event(at(6, "task-started", pid=42, hostname="w2@host"))
    state.event(at(6.1, "task-progress", token=7, stage="load-data", attempt=2, hostname="w2@host"))
    assert (task.state, task.token) == (states.STARTED, 7)
    state.event(
        at(
            7,
            "task-revoked",
            token=8,
            attempt=2,
            cause="cancel",
            reason="cancelled",
            hostname="celery@ops",
            terminated=False,
        )
    )
    assert (task.state, task.worker.hostname) == (states.REVOKED, "w2@host")
    # The owner hears of it later, and says so in its own words; its body then fails.
    state.event(at(8, "task-lease-lost", token=7, reason="taken over: a newer token owns the task", hostname="w2@host"))
    state.event(at(8.5, "task-failed", exception="LeaseLostError()", hostname="w2@host"))
    assert task.state == states.REVOKED
    assert [(a["attempt"], a["outcome"]) for a in task.attempts] == [(1, "abandoned"), (2, "cancelled")]
    assert task.attempts[1]["reason"] == "cancelled (celery fenced cancel)"


def test_a_cancel_nobody_hears_of_lists_no_attempt() -> None:
    task = state_of(
        at(0, "task-received", name="proj.report", args="()", kwargs="{}"),
        at(1, "task-revoked", token=3, cause="cancel", reason="cancelled", hostname="celery@ops", terminated=False),
    )
    assert task.state == states.REVOKED and task.attempts == []


def test_an_abandoned_task_shows_its_failure_and_keeps_its_worker() -> None:
    task = state_of(
        at(0, "task-started", pid=41),
        at(1, "task-progress", token=5, stage="load-data", attempt=4, takeovers=3),
        at(4, "task-abandoned", token=5, stage="load-data", attempt=4, cause="stalled", hostname="w9@host"),
    )
    assert task.state == states.FAILURE and "TaskAbandonedError" in task.exception
    assert task.worker.hostname == "w1@host"
    assert task.attempts[-1]["outcome"] == "abandoned"


def test_an_attempt_that_sent_no_event_of_its_own_is_still_listed() -> None:
    task = state_of(
        at(0, "task-received", name="proj.report", args="()", kwargs="{}"),
        at(0.1, "task-started", pid=41),
        at(0.2, "task-succeeded", result="1", runtime=0.1),
    )
    assert task.attempts == [
        {
            "attempt": 1,
            "token": None,
            "worker": "w1@host",
            "started": 1_700_000_000.1,
            "ended": 1_700_000_000.2,
            "stage": None,
            "outcome": "succeeded",
            "reason": None,
        }
    ]


def test_the_task_page_shows_the_attempts_as_an_escaped_table() -> None:
    task = state_of(at(0, "task-started", pid=41), at(1, "task-progress", token=1, stage="<b>x</b>", attempt=1))
    table = attempts_table(task.attempts)
    assert table.startswith('<table class="table table-sm fenced-attempts"')
    assert ">Outcome</th>" in table and "&lt;b&gt;x&lt;/b&gt;" in table and "<b>x" not in table
    assert str(task.attempts) not in table  # the row's mark, replaced on the rendered page
