"""The token rule of the Flower integration, on Celery's own event state (what Flower keeps)."""

from __future__ import annotations

import time
from typing import Any

import pytest
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


# The events of one attempt come from several processes (Celery's from the worker's main
# process, the attempt's own from its pool process, the reaper's and an operator's from
# theirs), each over its own connection: Flower hears them in any order. Each attempt keeps
# one entry with its outcome, and the task never shows a state the backend has moved past.

T1, CLAIM, T2, CANCEL = 11, 12, 14, 15  # the first owner's, the abandon's, the second owner's, the cancel's


def attempts_of(task: Any) -> list[tuple[int, int | None, str]]:
    return [(entry["attempt"], entry["token"], entry["outcome"]) for entry in task.attempts]


def a_stalled_first_attempt(announced: bool) -> dict[str, dict[str, Any]]:
    """What each process sends about a first attempt that stalls and is abandoned at once."""
    return {
        "received": at(0, "task-received", name="proj.report", args="()", kwargs="{}"),
        "started": at(0.1, "task-started", pid=41),
        "progress": at(0.6, "task-progress", token=T1, stage="load-data", attempt=1),
        "stalled": at(2.4, "task-stalled", token=T1, stage="load-data", attempt=1, bound="stage"),
        "lost": at(2.4, "task-lease-lost", token=T1, stage="load-data", attempt=1, reason="stalled: no progress"),
        "abandoned": at(2.5, "task-abandoned", token=CLAIM, stage="load-data", attempt=1, cause="stalled"),
    } | ({} if announced else {"progress": {}})


STALLED_ORDERS = {
    "lease-lost first": ("received", "started", "progress", "stalled", "lost", "abandoned"),
    "abandon first": ("received", "started", "progress", "stalled", "abandoned", "lost"),
    "abandon before the stall": ("received", "started", "progress", "abandoned", "stalled", "lost"),
    "abandon before the owner's first event": ("received", "started", "abandoned", "progress", "stalled", "lost"),
    "task-started last": ("received", "progress", "stalled", "lost", "abandoned", "started"),
    "task-started after the lease-lost": ("received", "progress", "stalled", "lost", "started", "abandoned"),
    "the abandon before everything": ("received", "abandoned", "started", "progress", "stalled", "lost"),
}


@pytest.mark.parametrize("announced", [True, False], ids=["announced", "not announced"])
@pytest.mark.parametrize("order", STALLED_ORDERS.values(), ids=STALLED_ORDERS.keys())
def test_a_stalled_attempts_lease_loss_and_its_abandon_are_one_attempt_in_any_order(
    order: tuple[str, ...], announced: bool
) -> None:
    """The lease-lost carries the owner's token, the abandon the claim's: matched by attempt."""
    sent = a_stalled_first_attempt(announced)
    task = state_of(*(sent[name] for name in order if sent[name]))
    assert attempts_of(task) == [(1, T1, "abandoned")]
    assert task.attempts[0]["worker"] == "w1@host" and task.attempts[0]["started"] == 1_700_000_000.1
    assert task.state == states.FAILURE and "TaskAbandonedError" in task.exception


def redrive(seconds: float) -> dict[str, Any]:
    """``celery fenced redrive``'s event (the reaper sends one too, at its re-send)."""
    return at(seconds, "task-takeover", token=CLAIM, stage="load-data", attempt=1, cause="redrive")


def test_the_reapers_redrive_heard_after_the_next_attempt_started_is_about_the_abandoned_one() -> None:
    """Seen in CI: the reaper's re-send and its event race the new attempt's task-started (the
    worker's main process sends both, over two connections); the event is about attempt 1."""
    sent = a_stalled_first_attempt(announced=True)
    task = state_of(
        *(sent[name] for name in STALLED_ORDERS["lease-lost first"]),
        dict(redrive(5), hostname="celery@ops"),
        at(5.1, "task-received", name="proj.report", args="()", kwargs="{}"),
        at(5.2, "task-started", pid=41),
        redrive(5.1),  # the reaper's, from the worker's main process
        at(5.3, "task-progress", token=T2, stage="", attempt=2, takeovers=0),
    )
    assert (task.state, task.token) == (states.STARTED, T2)
    assert attempts_of(task) == [(1, T1, "abandoned"), (2, T2, "running")]
    assert task.attempts[1]["started"] == 1_700_000_005.2


def test_a_redrive_heard_after_the_new_attempt_progressed_or_the_task_was_cancelled_changes_nothing() -> None:
    sent = a_stalled_first_attempt(announced=True)
    install()
    state = State()
    for name in STALLED_ORDERS["abandon first"]:
        state.event(sent[name])
    state.event(dict(redrive(5), hostname="celery@ops"))
    state.event(at(5.2, "task-started", pid=41))
    state.event(at(5.3, "task-progress", token=T2, stage="call-ai", attempt=2, takeovers=0))
    task = state.tasks["t1"]
    state.event(redrive(5.1))  # the reaper's, heard late
    assert (task.state, task.token) == (states.STARTED, T2)
    cancel = at(6, "task-revoked", token=CANCEL, attempt=2, cause="cancel", reason="cancelled", hostname="celery@ops")
    state.event(cancel)
    state.event(redrive(5.1))  # and once more, after the cancel
    assert (task.state, task.token) == (states.REVOKED, CANCEL)
    assert attempts_of(task) == [(1, T1, "abandoned"), (2, T2, "cancelled")]


def test_an_abandon_heard_after_its_redrive_does_not_show_the_task_failed_again() -> None:
    """An operator's redrive can follow the reaper's claim before the reaper sent its event."""
    sent = a_stalled_first_attempt(announced=True)
    task = state_of(
        *(sent[name] for name in ("received", "started", "progress", "stalled", "lost")),
        dict(redrive(2.6), hostname="celery@ops"),
        sent["abandoned"],
    )
    assert task.state == "TAKEOVER" and not task.exception
    assert attempts_of(task) == [(1, T1, "abandoned")]
    task = state_of(
        *(sent[name] for name in ("received", "started", "progress", "stalled", "lost")),
        dict(redrive(2.6), hostname="celery@ops"),
        at(3, "task-progress", token=T2, stage="", attempt=2, takeovers=0),
        sent["abandoned"],
    )
    assert (task.state, task.token) == (states.STARTED, T2)
    assert attempts_of(task) == [(1, T1, "abandoned"), (2, T2, "running")]


TAKEN_OVER = {
    "takeover before the lease-lost": ("started", "progress", "stalled", "takeover", "lost", "started2", "progress2"),
    "lease-lost before the takeover": ("started", "progress", "stalled", "lost", "takeover", "started2", "progress2"),
    "lease-lost after the next attempt": (
        "started",
        "progress",
        "stalled",
        "takeover",
        "started2",
        "progress2",
        "lost",
    ),
    "the next attempt before the takeover": ("started", "progress", "stalled", "started2", "progress2", "takeover"),
    "the next attempt's own event first": ("started", "progress", "progress2", "started2", "stalled", "lost"),
}


@pytest.mark.parametrize("order", TAKEN_OVER.values(), ids=TAKEN_OVER.keys())
def test_a_takeover_and_the_old_owners_lease_loss_are_one_attempt_in_any_order(order: tuple[str, ...]) -> None:
    sent = {
        "started": at(0.1, "task-started", pid=41),
        "progress": at(0.6, "task-progress", token=T1, stage="load-data", attempt=1),
        "stalled": at(2.4, "task-stalled", token=T1, stage="load-data", attempt=1, bound="stage"),
        "lost": at(2.4, "task-lease-lost", token=T1, stage="load-data", attempt=1, reason="stalled: no progress"),
        "takeover": at(2.5, "task-takeover", token=T1, stage="load-data", attempt=1, cause="stalled"),
        "started2": at(2.6, "task-started", pid=52, hostname="w2@host"),
        "progress2": at(2.7, "task-progress", token=T2, stage="", attempt=2, takeovers=1, hostname="w2@host"),
    }
    task = state_of(*(sent[name] for name in order))
    assert [(a, t, o) for a, t, o in attempts_of(task)] == [(1, T1, "lease-lost"), (2, T2, "running")]
    assert [entry["worker"] for entry in task.attempts] == ["w1@host", "w2@host"]
    assert (task.state, task.token, task.worker.hostname) == (states.STARTED, T2, "w2@host")


def test_progress_heard_after_its_owners_lease_loss_does_not_show_the_task_running() -> None:
    """Sent before the loss, heard after it (a new connection after a broker error)."""
    task = state_of(
        at(0.1, "task-started", pid=41),
        at(0.6, "task-progress", token=T1, stage="load-data", attempt=1),
        at(2.4, "task-lease-lost", token=T1, stage="load-data", attempt=1, reason="stalled: no progress"),
        at(2.0, "task-progress", token=T1, stage="call-ai", attempt=1),
    )
    assert task.state == "STALLED"
    assert attempts_of(task) == [(1, T1, "lease-lost")]


RETRIED = {
    "in order": ("started", "retried", "received2", "started2", "progress2", "succeeded2"),
    "the retry's attempt first": ("started", "received2", "started2", "progress2", "retried", "succeeded2"),
    "its own event before any": ("started", "progress2", "received2", "started2", "retried", "succeeded2"),
    "its own event before the retried": ("started", "received2", "progress2", "retried", "started2", "succeeded2"),
}


@pytest.mark.parametrize("order", RETRIED.values(), ids=RETRIED.keys())
def test_a_retrys_attempt_is_an_attempt_of_its_own_in_any_order(order: tuple[str, ...]) -> None:
    """A quick first attempt retries before it announced its token; with countdown=0 the retry
    can start on the same worker before Celery's task-retried of the first is sent."""
    sent = {
        "started": at(0.1, "task-started", pid=41),
        "retried": at(0.2, "task-retried", exception="Retry()", traceback=""),
        "received2": at(0.21, "task-received", name="proj.report", args="()", kwargs="{}", retries=1),
        "started2": at(0.22, "task-started", pid=41),
        "progress2": at(0.23, "task-progress", token=T2, stage="", attempt=2, takeovers=0),
        "succeeded2": at(0.5, "task-succeeded", result="'done'", runtime=0.3),
    }
    task = state_of(at(0, "task-received", name="proj.report", args="()", kwargs="{}"), *(sent[n] for n in order))
    assert attempts_of(task) == [(1, None, "retried"), (2, T2, "succeeded")]
    assert [entry["started"] for entry in task.attempts] == [1_700_000_000.1, 1_700_000_000.22]
    assert task.state == states.SUCCESS


def test_a_cancel_heard_before_the_attempts_own_first_event_is_that_attempts() -> None:
    """A takeover's new owner announces its token at its acquire; the cancel's event can come first."""
    task = state_of(
        at(0, "task-received", name="proj.report", args="()", kwargs="{}"),
        at(0.1, "task-started", pid=41),
        at(0.6, "task-progress", token=T1, stage="load-data", attempt=1),
        at(2.4, "task-lease-lost", token=T1, stage="load-data", attempt=1, reason="stalled: no progress"),
        at(2.5, "task-takeover", token=T1, stage="load-data", attempt=1, cause="stalled"),
        at(2.6, "task-started", pid=52, hostname="w2@host"),
        at(2.7, "task-revoked", token=CANCEL, attempt=2, cause="cancel", reason="cancelled", hostname="celery@ops"),
        at(2.65, "task-progress", token=T2, stage="", attempt=2, takeovers=1, hostname="w2@host"),
        at(3.0, "task-lease-lost", token=T2, attempt=2, reason="renewal refused: cancelled (celery fenced cancel)"),
    )
    assert task.state == states.REVOKED
    assert attempts_of(task) == [(1, T1, "lease-lost"), (2, T2, "cancelled")]


@pytest.mark.parametrize("owner_first", [False, True], ids=["cancel first", "owner first"])
def test_a_cancel_and_its_owners_lease_loss_are_one_attempt_with_the_cancels_words(owner_first: bool) -> None:
    """The owner hears of the cancel at its next renewal: its lease-lost can reach Flower first."""
    cancel = at(2, "task-revoked", token=CANCEL, attempt=1, cause="cancel", reason="bad input", hostname="celery@ops")
    lost = at(2.4, "task-lease-lost", token=T1, attempt=1, reason="renewal refused: cancelled (celery fenced cancel)")
    events = [lost, cancel] if owner_first else [cancel, lost]
    task = state_of(
        at(0.1, "task-started", pid=41),
        at(0.6, "task-progress", token=T1, stage="load-data", attempt=1),
        *events,
        at(2.5, "task-failed", exception="LeaseLostError()"),
    )
    assert (task.state, task.token) == (states.REVOKED, CANCEL)
    assert attempts_of(task) == [(1, T1, "cancelled")]
    assert task.attempts[0]["reason"] == task.reason == "cancelled (celery fenced cancel): bad input"
    assert task.attempts[0]["ended"] == 1_700_000_000 + (2.4 if owner_first else 2)


def test_an_attempt_announced_after_celery_said_it_ended_is_one_attempt() -> None:
    """A first attempt is announced by its first renewal: one in flight as the body returns is
    heard after the worker's task-succeeded; a takeover's, sent at its acquire, can be heard
    after it too."""
    task = state_of(
        at(0, "task-received", name="proj.report", args="()", kwargs="{}"),
        at(0.1, "task-started", pid=41),
        at(0.6, "task-succeeded", result="1", runtime=0.5),
        at(0.55, "task-progress", token=T1, stage="load-data", attempt=1),
    )
    assert attempts_of(task) == [(1, T1, "succeeded")] and task.state == states.SUCCESS
    task = state_of(
        at(0, "task-received", name="proj.report", args="()", kwargs="{}"),
        at(0.1, "task-started", pid=41),
        at(0.6, "task-progress", token=T1, stage="load-data", attempt=1),
        at(2.4, "task-lease-lost", token=T1, stage="load-data", attempt=1, reason="stalled: no progress"),
        at(2.6, "task-started", pid=52, hostname="w2@host"),
        at(2.8, "task-succeeded", result="2", runtime=0.2, hostname="w2@host"),
        at(2.5, "task-takeover", token=T1, stage="load-data", attempt=1, cause="stalled"),
        at(2.7, "task-progress", token=T2, stage="", attempt=2, takeovers=1, hostname="w2@host"),
    )
    assert attempts_of(task) == [(1, T1, "lease-lost"), (2, T2, "succeeded")] and task.state == states.SUCCESS


def test_a_flower_started_mid_way_lists_the_attempt_under_its_own_number() -> None:
    task = state_of(
        at(5.0, "task-started", pid=41),  # Flower heard nothing of the task before
        at(5.1, "task-progress", token=T2, stage="", attempt=3, takeovers=2),
    )
    assert attempts_of(task) == [(3, T2, "running")]


def test_a_retry_is_shown_as_a_retry_not_a_takeover_and_the_numbers_are_explained() -> None:
    """Two things said a takeover of a retry: the reaper's re-send of a retry whose message never
    started (cause ``retry``), and the retried run's acquire. Both say retry now."""
    received = at(0, "task-received", name="proj.report", args="()", kwargs="{}")
    first = (
        at(0.1, "task-started", pid=41),
        at(0.6, "task-progress", token=T1, stage="load-data", attempt=1),
        at(0.7, "task-retried", exception="Retry(countdown=5)", traceback=""),
    )
    resent = at(66.0, "task-takeover", token=T1, stage="load-data", attempt=1, takeovers=0, cause="retry")
    task = state_of(received, *first, resent)
    assert task.state == states.RETRY  # not TAKEOVER: nobody took anything over
    assert attempts_of(task) == [(1, T1, "retried")]
    assert "sent again" in task.attempts[0]["reason"]
    retried_run = at(
        66.2,
        "task-progress",
        token=T2,
        stage="",
        attempt=2,
        takeovers=0,
        cause="retry",
        retries=1,
        reason="retry 1 of the task, not a takeover",
    )
    task = state_of(received, *first, at(66.1, "task-started", pid=41), retried_run)
    assert attempts_of(task) == [(1, T1, "retried"), (2, T2, "running")]
    assert task.attempts[1]["reason"] == "retry 1 of the task, not a takeover"
    assert (task.cause, task.takeovers) == ("retry", 0)
    table = attempts_table(task.attempts)
    assert "two retries show attempt 3, takeovers 0" in table and "a retry is not one" in table
