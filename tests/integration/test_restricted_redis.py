"""A lease Redis whose user may not run every command (an ACL, as managed services restrict
commands): the worker refuses at start naming what is missing, or serves with a warning
naming what is unchecked; a Redis error that repeats ends the task in a FAILURE naming it."""

from __future__ import annotations

import pytest

from celery_fenced._worker.lifecycle import SEND_AGAIN_LIMIT, SENT_AGAIN_HEADER
from celery_fenced.exceptions import LeaseUnavailableError
from tests.integration.conftest import APP, KEYS, Cluster, stored
from tests.integration.test_worker_checks import start_and_fail
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration

PASSWORD = "fenced-test-secret"


def restricted_backend(cluster: Cluster, user: str, *rules: str) -> str:
    """Create ``user`` on the test's Redis with ``rules`` (ACL SETUSER); its fenced backend URL."""
    with cluster.server.client() as admin:
        admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{PASSWORD}", "~*", "&*", *rules)
    return cluster.backend_url.replace("redis://", f"redis://{user}:{PASSWORD}@", 1)


def test_a_user_that_may_not_run_info_is_refused_at_start_in_one_line(own_cluster: Cluster) -> None:
    backend = restricted_backend(own_cluster, "no-info", "+@all", "-info")
    log = start_and_fail(own_cluster, result_backend=backend)
    assert "celery-fenced: the lease Redis user may not run INFO" in log
    assert "ACL SETUSER <user> +info" in log
    assert "Traceback" not in log


def test_a_user_without_config_serves_fenced_tasks_and_says_what_is_unchecked(own_cluster: Cluster) -> None:
    # The rule set docs/guarantees.rst gives for a restricted Redis: no CONFIG, KEYS, FLUSHALL...
    backend = restricted_backend(own_cluster, "fenced", "+@all", "-@dangerous", "+info")
    app = own_cluster.app()
    worker = own_cluster.worker("w1", result_backend=backend)
    assert "could not read the lease Redis's maxmemory-policy" in worker.log()
    assert "no permissions to run the 'config|get' command" in worker.log()
    results = [app.steady.delay(2, 0.01) for _ in range(3)]
    for result in results:
        assert result.get(timeout=30) == f"done by {stored(own_cluster, result.id)['fence_token']}"  # type: ignore[index]


def test_a_redis_error_that_repeats_ends_the_task_in_a_failure_naming_it(own_cluster: Cluster) -> None:
    backend = restricted_backend(own_cluster, "revoked", "+@all")
    app = own_cluster.app()
    worker = own_cluster.worker("w1", result_backend=backend)
    with own_cluster.server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "revoked", "-info")  # taken away while the worker runs
    # A delivery sent again all but the last time: one more re-send, then the FAILURE.
    result = app.steady.apply_async((2, 0.01), headers={SENT_AGAIN_HEADER: SEND_AGAIN_LIMIT - 1})
    with pytest.raises(LeaseUnavailableError, match="the lease Redis user may not run INFO") as failure:
        result.get(timeout=60)
    assert f"could not be acquired on {SEND_AGAIN_LIMIT + 1} deliveries in a row" in str(failure.value)
    assert worker.log().count("sending it again") == 1
    assert not own_cluster.runs(result.id)  # the body never ran
    assert stored(own_cluster, result.id)["status"] == "FAILURE"  # type: ignore[index]
    assert not own_cluster.results.exists(KEYS.token)  # no token was ever handed out


def start_beat_and_fail(cluster: Cluster, **settings: object) -> str:
    """Start beat (the reaper on its schedule), which must refuse to start; its log."""
    from tests.support.processes import CeleryProcess

    argv = ["-A", APP, "beat", "-l", "INFO", "-s", str(cluster.tmp_path / "refused-schedule")]
    proc = CeleryProcess("refused-beat", argv, cluster.env(**settings), cluster.tmp_path / "refused-beat.log", "")
    cluster.processes.append(proc)
    wait_until(lambda: proc.proc.poll() is not None, 60, "beat to refuse to start")
    assert proc.proc.returncode != 0
    return proc.log()


def test_beat_whose_user_may_not_run_info_is_refused_at_start_in_one_line(own_cluster: Cluster) -> None:
    """As a worker is: beat's reaper could never take a task over with this user."""
    backend = restricted_backend(own_cluster, "no-info", "+@all", "-info")
    log = start_beat_and_fail(own_cluster, result_backend=backend)
    (line,) = [line for line in log.splitlines() if "celery-fenced:" in line]
    assert "celery-fenced: the lease Redis user may not run INFO (" in line
    assert "grant it (ACL SETUSER <user> +info)" in line
    assert "Traceback" not in log


def test_a_reaper_pass_in_beat_that_fails_names_the_command_and_the_fix(own_cluster: Cluster) -> None:
    """INFO taken away while beat runs: each pass fails in a script (Redis names only the
    script); the line names the command and how to grant it."""
    backend = restricted_backend(own_cluster, "loses-info", "+@all")
    app = own_cluster.app()
    beat = own_cluster.beat(loglevel="DEBUG", result_backend=backend)
    # Past its check at start: beat ticks (its reap lines show at DEBUG).
    wait_until(lambda: "Sending due task celery_fenced.reap" in beat.log(), 20, "beat's first reap")
    with own_cluster.server.client() as admin:
        admin.execute_command("ACL", "SETUSER", "loses-info", "-info")
    store = app.app.backend.lease_store  # the test's own client may run everything
    call = {"task": app.steady.name, "args": [1, 0.01], "kwargs": {}, "options": {}}
    store.acquire("gone", "w1@host/1/a", ttl_ms=1, task_name=app.steady.name, max_takeovers=3, call=call)
    wait_until(lambda: "reaper pass in beat failed" in beat.log(), 20, "a reaper pass to fail")
    (line,) = [line for line in beat.log().splitlines() if "reaper pass in beat failed" in line]
    assert "the lease Redis user may not run INFO (" in line
    assert "grant it (ACL SETUSER <user> +info)" in line
