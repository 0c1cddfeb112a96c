"""What the fenced backend reports after each write (_backend/writes.py): the report, the default
hook that logs a refused write and signals a stale one, and the app's own hook."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_fenced import signals
from celery_fenced._backend import writes
from celery_fenced._backend.writes import WriteReport, log_write, set_hook
from celery_fenced._celery.apps import record_of
from celery_fenced._lease.state import StoreOutcome, StoreResult
from tests.support.processes import wait_until


def report(code: StoreOutcome, detail: str = "", *, state: str = "SUCCESS", token: int | None = 4) -> WriteReport:
    return WriteReport(task_id="t1", state=state, token=token, outcome=StoreResult(code, detail))


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """What the backend's logger said, as (level, message); other receivers of the signal
    (the Django app's) log on loggers of their own."""
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == writes.logger.name]


@pytest.fixture
def stale_signals() -> Iterator[list[dict[str, Any]]]:
    """What ``stale_write_rejected`` sends while the test runs."""
    heard: list[dict[str, Any]] = []

    def receive(sender: Any = None, **kwargs: Any) -> None:
        kwargs.pop("signal", None)
        heard.append({"sender": sender, **kwargs})

    signals.stale_write_rejected.connect(receive, weak=False)
    yield heard
    signals.stale_write_rejected.disconnect(receive)


def test_the_current_token_is_read_from_a_stale_answer_only() -> None:
    assert report(StoreOutcome.STALE, "9").current_token == 9
    assert report(StoreOutcome.STALE, "").current_token is None
    assert report(StoreOutcome.LAPSED, "9").current_token is None  # a detail that is not a token
    assert report(StoreOutcome.STORED).current_token is None


def test_the_current_token_is_what_store_lua_answers_a_stale_write(fenced_app: Celery) -> None:
    store = fenced_app.backend.lease_store
    first = store.acquire("t1", "host/1/a", ttl_ms=50, task_name="proj.task", max_takeovers=3).state
    wait_until(lambda: store.server_time_ms() > (store.read("t1").lease_expire_at or 0), 5, "the first lease to lapse")
    second = store.acquire("t1", "host/2/b", ttl_ms=3000, task_name="proj.task", max_takeovers=3).state
    assert second.owner_token > first.owner_token
    outcome = store.store("t1", first.owner_token, b"{}", state="SUCCESS", kind="ready", expires_ms=0)
    stale = WriteReport("t1", "SUCCESS", first.owner_token, outcome)
    assert stale.current_token == second.owner_token


def test_a_stored_write_is_not_logged(caplog: pytest.LogCaptureFixture, stale_signals: list[dict[str, Any]]) -> None:
    with caplog.at_level("INFO", logger=writes.logger.name):
        log_write(None, report(StoreOutcome.STORED))
    assert said(caplog) == [] and stale_signals == []


def test_a_stale_write_is_logged_as_a_warning_and_signalled(
    caplog: pytest.LogCaptureFixture, stale_signals: list[dict[str, Any]]
) -> None:
    with caplog.at_level("INFO", logger=writes.logger.name):
        log_write(None, report(StoreOutcome.STALE, "7"), task_name="proj.report", stage="load-data")
    assert writes.logger.name == "celery_fenced.backend"
    assert said(caplog) == [
        (
            "WARNING",
            "stale write dropped: task proj.report[t1] state=SUCCESS stage=load-data token=4 current token=7",
        )
    ]
    assert stale_signals == [
        {"sender": "proj.report", "task_id": "t1", "token": 4, "current_token": 7, "state": "SUCCESS"}
    ]


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            "RETRY",
            "request cancelled (a cold shutdown) while running task t1: lease lapsed, the task will be taken over",
        ),
        ("FAILURE", "worker lost while running task t1: lease lapsed, the task will be taken over"),
    ],
)
def test_a_lapsed_write_says_why_the_lease_lapsed(
    state: str, message: str, caplog: pytest.LogCaptureFixture, stale_signals: list[dict[str, Any]]
) -> None:
    with caplog.at_level("INFO", logger=writes.logger.name):
        log_write(None, report(StoreOutcome.LAPSED, state=state, token=None))
    assert said(caplog) == [("WARNING", message)]
    assert stale_signals == []


def test_a_retry_overtaken_by_its_own_retry_is_logged_at_info_and_not_signalled(
    caplog: pytest.LogCaptureFixture, stale_signals: list[dict[str, Any]]
) -> None:
    with caplog.at_level("INFO", logger=writes.logger.name):
        log_write(None, report(StoreOutcome.STALE, "8", state="RETRY"), overtaken_by_its_retry=True)
    assert said(caplog) == [("INFO", "RETRY of task t1 not stored: its retry already runs (token 8)")]
    assert stale_signals == []


@pytest.mark.parametrize("code", [StoreOutcome.FINISHED, StoreOutcome.FOREIGN, StoreOutcome.STICKY])
def test_other_refusals_are_logged_at_info(
    code: StoreOutcome, caplog: pytest.LogCaptureFixture, stale_signals: list[dict[str, Any]]
) -> None:
    with caplog.at_level("INFO", logger=writes.logger.name):
        log_write(None, report(code, "why"))
    assert said(caplog) == [("INFO", f"write of SUCCESS for task t1 dropped: {code} (why)")]
    assert stale_signals == []


def test_set_hook_makes_the_hook_hear_the_apps_writes(fenced_app: Celery) -> None:
    heard: list[tuple[Any, WriteReport]] = []

    def hook(backend: Any, written: WriteReport) -> None:
        heard.append((backend, written))

    set_hook(fenced_app, hook)
    assert record_of(fenced_app).write_hook is hook
    assert record_of(Celery("other", set_as_current=False)).write_hook is None  # the app's, no other's
    fenced_app.backend.store_result("t2", 5, "SUCCESS")
    ((backend, written),) = heard
    assert backend is fenced_app.backend
    assert (written.task_id, written.state, written.token, written.outcome.code) == ("t2", "SUCCESS", None, "stored")
