"""A lease Redis whose user may not run every command (an ACL, as managed services restrict
commands): the worker refuses at start naming what is missing, or serves with a warning
naming what is unchecked; a Redis error that repeats ends the task in a FAILURE naming it."""

from __future__ import annotations

import pytest

from celery_fenced._worker.lifecycle import SEND_AGAIN_LIMIT, SENT_AGAIN_HEADER
from celery_fenced.exceptions import LeaseUnavailableError
from tests.integration.conftest import KEYS, Cluster, stored
from tests.integration.test_worker_checks import start_and_fail

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
