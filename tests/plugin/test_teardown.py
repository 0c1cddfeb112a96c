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
