"""Bodies that never finish, on real workers: time limits, ``revoke(terminate=True)``, a cold
shutdown, a ``SystemExit`` or ``KeyboardInterrupt`` escaping the body.

Two rules (docs/guarantees.rst, "Time limits and revoke on every pool" and "A body that never
finished"): a time limit or a revoke stores what plain Celery stores for a plain task on the
same pool; a body stopped without an end Celery stores is never DONE: the task finishes on
another worker (or on the same one, once the reaper sends it again).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from celery.exceptions import TaskRevokedError, TimeLimitExceeded

from tests.integration.conftest import Cluster, lease, stored
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration


def outcome(cluster: Cluster, task_id: str) -> tuple[str, str] | None:
    """``(state, result type)`` stored for ``task_id``: the exception's type for an error."""
    meta = stored(cluster, task_id)
    if meta is None:
        return None
    result = meta.get("result")
    return meta["status"], result.get("exc_type") if isinstance(result, dict) else type(result).__name__


def ready(cluster: Cluster, task_id: str) -> tuple[str, str] | None:
    found = outcome(cluster, task_id)
    return found if found is not None and found[0] in ("SUCCESS", "FAILURE", "REVOKED") else None


def finished_once_by_the_last_run(
    cluster: Cluster, task_id: str, result: Any, ran_again: bool = True
) -> list[dict[str, Any]]:
    """The task ran again after its unfinished run (unless ``ran_again`` is false), and exactly
    the last run's end was stored."""
    value = result.get(timeout=30)
    runs = cluster.runs(task_id)
    assert len(runs) >= (2 if ran_again else 1), runs
    assert value.endswith(f"by {runs[-1]['token']}"), (value, runs)
    meta = stored(cluster, task_id)
    assert meta is not None and meta["status"] == "SUCCESS" and meta["fence_token"] == runs[-1]["token"], meta
    assert lease(cluster, task_id)["status"] == "DONE"
    return runs


# -- time limits and revoke: what plain Celery stores, on every pool --------------------------------


def test_a_hard_time_limit_on_gevent_stores_its_failure_and_runs_the_errback(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", pool="gevent", concurrency=4)
    result = app.healthy_for.apply_async((8,), time_limit=2, link_error=app.record_errback.s())
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=20)
    assert outcome(cluster, result.id) == ("FAILURE", "TimeLimitExceeded")
    assert lease(cluster, result.id)["status"] == "DONE"
    errback = wait_until(lambda: cluster.record.lrange(f"errback:{result.id}", 0, -1), 10, "the errback")
    assert errback == ["TimeLimitExceeded"]
    assert len(cluster.runs(result.id)) == 1


def test_revoke_terminate_on_gevent_stores_revoked(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", pool="gevent", concurrency=4)
    result = app.healthy_for.delay(20)
    cluster.wait_runs(result.id, 1)
    app.app.control.revoke(result.id, terminate=True)
    with pytest.raises(TaskRevokedError):
        result.get(timeout=20)
    assert outcome(cluster, result.id) == ("REVOKED", "TaskRevokedError")
    assert lease(cluster, result.id)["status"] == "DONE"
    assert len(cluster.runs(result.id)) == 1


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo", "gevent"])
def test_time_limits_and_revoke_store_what_plain_celery_stores(cluster: Cluster, pool: str) -> None:
    """Each case runs a plain task and a fenced one side by side; both must end alike.

    Where the pool ignores a limit (threads, solo: both limits; gevent: the soft one) or
    cannot terminate (threads, solo), plain Celery stores the task's SUCCESS, and so does
    the fenced task.
    """
    app = cluster.app()
    cluster.worker("w1", pool=pool, concurrency=1 if pool == "solo" else 6)
    cases: dict[str, tuple[Any, Any]] = {}
    for case, options in (("hard", {"time_limit": 1}), ("soft", {"soft_time_limit": 1})):
        plain = app.plain_healthy_for.apply_async((3,), **options)
        fenced = app.healthy_for.apply_async((3,), **options)
        cases[case] = (plain, fenced)
    plain, fenced = app.plain_healthy_for.delay(6), app.healthy_for.delay(6)
    for started in (plain, fenced):
        cluster.wait_runs(started.id, 1, timeout=40)
        app.app.control.revoke(started.id, terminate=True)
    cases["revoke"] = (plain, fenced)
    for case, (plain, fenced) in cases.items():
        if case == "revoke" and pool in ("threads", "solo"):
            # The pool cannot terminate: the body runs on and its SUCCESS is the end. Celery 5.6
            # also stores REVOKED for a plain task while it still runs, which its SUCCESS then
            # overwrites; the fenced store refuses that write (the worker's main process is not
            # the owner), so only the end compares.
            ended = ("SUCCESS", "str")
            expected = wait_until(lambda plain=plain: ready(cluster, plain.id) == ended and ended, 40, "plain end")
        else:
            expected = wait_until(lambda plain=plain: ready(cluster, plain.id), 40, f"plain {case}")
        got = wait_until(lambda fenced=fenced: ready(cluster, fenced.id), 40, f"fenced {case}")
        assert got == expected, (pool, case)
        assert lease(cluster, fenced.id)["status"] == "DONE", (pool, case)
        assert len(cluster.runs(fenced.id)) == 1, (pool, case)


# -- a body that never finished is taken over ---------------------------------------------------------


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo", "gevent"])
def test_a_cold_shutdown_leaves_the_running_task_to_another_worker(cluster: Cluster, pool: str) -> None:
    app = cluster.app()
    stopping = cluster.worker("w1", pool=pool, concurrency=1)
    result = app.healthy_for.delay(8)
    [first] = cluster.wait_runs(result.id, 1)
    cluster.worker("w2", pool=pool, concurrency=1)
    os.kill(stopping.pid, signal.SIGTERM)  # a deploy stops the worker...
    wait_until(lambda: "Warm shutdown" in stopping.log(), 10, "the warm shutdown")
    os.kill(stopping.pid, signal.SIGQUIT)  # ...and its grace runs out: stop now
    wait_until(lambda: stopping.proc.poll() is not None, 20, "the worker to exit")
    # On threads Celery's cold shutdown stops with NotImplementedError (the pool cannot kill a
    # job) while the body's thread goes on: the body may finish there, before the process is
    # gone, or be taken over once its lease runs out. Either way it finishes once.
    runs = finished_once_by_the_last_run(cluster, result.id, result, ran_again=pool != "threads")
    if len(runs) == 1:
        assert pool == "threads", runs
        assert cluster.record.lrange(f"finished:{result.id}", 0, -1) == [str(first["token"])]
        return
    assert [run["hostname"].split("@")[0] for run in runs] == ["w1", "w2"], runs
    assert runs[1]["token"] > first["token"]
    assert cluster.record.lrange(f"finished:{result.id}", 0, -1) == [str(runs[1]["token"])]


def test_a_body_a_failed_cold_shutdown_left_running_ends_with_its_own_error(cluster: Cluster) -> None:
    """On threads Celery's cold shutdown cancels the request but cannot stop the body's thread
    (``NotImplementedError``): nothing is raised into the body, which runs on under its lease.
    An error it then raises is its own end, stored once, not a body that never finished and
    runs again (its side effects twice)."""
    app = cluster.app()
    stopping = cluster.worker("w1", pool="threads", concurrency=1)
    result = app.fails_when_woken.delay()
    [first] = cluster.wait_runs(result.id, 1)
    cluster.worker("w2", pool="threads", concurrency=1)
    cluster.beat()
    os.kill(stopping.pid, signal.SIGTERM)
    wait_until(lambda: "Warm shutdown" in stopping.log(), 10, "the warm shutdown")
    os.kill(stopping.pid, signal.SIGQUIT)
    wait_until(lambda: "does not implement kill_job" in stopping.log(), 10, "Celery's cold shutdown to cancel")
    cluster.wake(result.id)
    with pytest.raises(ValueError, match="failed by its own error"):
        result.get(timeout=20)
    wait_until(lambda: stopping.proc.poll() is not None, 20, "the worker to exit")
    runs = cluster.runs(result.id)
    finished = cluster.record.lrange(f"finished:{result.id}", 0, -1)
    if len(runs) == 1:
        # The body woke while its worker still ran: its error is its own end, stored once.
        assert stored(cluster, result.id)["fence_token"] == first["token"]
        assert finished == [str(first["token"])]
    else:
        # The worker process exited before the body's thread woke (Celery 5.6's cold shutdown
        # can end the process first): that body never finished, so its lease was taken over
        # and the task ran once more, to its own error, stored once by the new owner.
        assert len(runs) == 2 and runs[1]["token"] > first["token"], runs
        assert stored(cluster, result.id)["fence_token"] == runs[1]["token"]
        assert finished[-1] == str(runs[1]["token"]) and len(finished) <= 2, finished
    assert lease(cluster, result.id)["status"] == "DONE"


@pytest.mark.parametrize(("pool", "kind"), [("prefork", "exit"), ("threads", "exit"), ("gevent", "kbd")])
def test_a_system_exit_escaping_the_body_leaves_the_task_to_a_takeover(cluster: Cluster, pool: str, kind: str) -> None:
    """Plain Celery stores ``WorkerLostError`` for it on prefork, and nothing at all (the task
    stays STARTED) on threads and gevent; solo's worker dies of it. A fenced task's lease is
    taken over: the task runs again and finishes."""
    app = cluster.app()
    cluster.worker("w1", pool=pool, concurrency=2)
    result = app.exits_once.delay(kind)
    runs = finished_once_by_the_last_run(cluster, result.id, result)
    assert len(runs) == 2 and runs[1]["attempt"] == 2, runs
