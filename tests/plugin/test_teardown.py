"""A user's test session that leaves a task running ends cleanly, without retrying a stopped Redis."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

USERS_TEST = """
import time

from celery_fenced import ProgressLeasedTask


def test_leaves_a_task_running(fenced_app, fenced_worker, fenced_helpers):
    @fenced_app.task(bind=True, base=ProgressLeasedTask)
    def long_running(self):
        for _ in range(20):
            self.progress("load-data")
            time.sleep(0.1)
        return "stored"

    fenced_worker.reload()
    result = long_running.delay()
    fenced_helpers.wait_for_lease(result.id, "RUNNING")
    # the test returns while the task still runs for about two seconds
"""


def test_a_task_still_running_at_teardown_ends_before_redis_stops(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)  # a plain Celery user's session
    pytester.makepyfile(test_users_task=USERS_TEST)
    outcome = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:django", timeout=120)
    outcome.assert_outcomes(passed=1)
    output = outcome.stdout.str() + outcome.stderr.str()
    assert "Connection to Redis lost" not in output
    assert "Exception raised outside body" not in output


USERS_TESTS_IN_A_ROW = """
import threading

from celery_fenced import ProgressLeasedTask
from celery_fenced.harness import wait_until


def test_runs_a_task(fenced_app, fenced_worker):
    @fenced_app.task(bind=True, base=ProgressLeasedTask)
    def add(self, x, y):
        self.progress("add")
        return x + y

    fenced_worker.reload()
    assert add.delay(1, 2).get(timeout=10) == 3


def test_after_it_nothing_of_that_worker_runs():
    def left():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("celery-fenced"))

    wait_until(lambda: not left(), 5, "the worker's threads to stop")
"""


def test_a_workers_threads_stop_with_its_fixture(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """The heartbeat, the reaper, the reservation writer and the liveness record of the
    in-process worker stop when the test that used it ends, not with the session (they would
    read and write the test's Redis, or retry it once stopped, while later tests run)."""
    monkeypatch.delenv("DJANGO_SETTINGS_MODULE", raising=False)
    pytester.makepyfile(test_users_tasks=USERS_TESTS_IN_A_ROW)
    outcome = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:django", timeout=120)
    outcome.assert_outcomes(passed=2)
