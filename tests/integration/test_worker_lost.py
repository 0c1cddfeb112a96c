"""Retries whose process or message was lost: a fenced task is retried as Celery retries it
(the retry's own arguments and ``retries``), never by sending again the call of the run that
retried."""

from __future__ import annotations

import os
import signal
import time

import pytest

from celery_fenced._celery.compat import CELERY_VERSION
from tests.integration.conftest import Cluster, lease, stored
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration


@pytest.mark.skipif(CELERY_VERSION < (5, 7), reason="task_retry_on_worker_lost is Celery 5.7's")
def test_a_process_lost_with_retry_on_worker_lost_is_retried_as_celery_retries_it(cluster: Cluster) -> None:
    """Celery 5.7 retries a task whose process was lost (``retry_on_worker_lost``): a retry
    message after ``default_retry_delay`` with ``retries`` + 1, and RETRY stored from the main
    process. The reaper must leave the task to that message, not send the original call
    (``retries`` 0) before it: ``max_retries`` would never be reached."""
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, fenced_requeue_timeout=1)
    result = app.killed_then_retried.delay()
    assert result.get(timeout=30) == "retried 1"
    runs = cluster.runs(result.id)
    assert [run["retries"] for run in runs] == [0, 1]
    assert runs[1]["started"] - runs[0]["started"] >= 4  # the retry's countdown
    assert "re-sent (cause=retry" not in worker.log()


@pytest.mark.skipif(CELERY_VERSION < (5, 7), reason="task_retry_on_worker_lost is Celery 5.7's")
def test_a_reaper_pass_before_the_retry_is_stored_leaves_the_task_to_the_retry(cluster: Cluster) -> None:
    """Celery's main process sends ``retry_on_worker_lost``'s retry, then stores RETRY. Paused
    in between (longer than a reaper interval: a reaper pass falls in it), the lease of the
    lost process must already wait for that retry: a lease merely given up would be claimed by
    that pass, and the original call (``retries`` 0) sent as a takeover before the retry."""
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, fenced_requeue_timeout=1)
    result = app.killed_then_retried.signature().freeze()
    cluster.record.set(f"pause-after-retry:{result.id}", 1)
    app.killed_then_retried.apply_async(task_id=result.id)
    assert result.get(timeout=30) == "retried 1"
    runs = cluster.runs(result.id)
    assert [run["retries"] for run in runs] == [0, 1], runs
    assert not cluster.record.exists(f"pause-after-retry:{result.id}"), "the pause was not taken"
    assert "re-sent (cause=" not in worker.log()
    assert "its process was lost: lease kept for Celery's retry" in worker.log()


def test_a_retry_message_lost_with_its_worker_is_sent_again_with_the_retrys_arguments(cluster: Cluster) -> None:
    """A retry's message held in a worker's eta timer is lost with that worker (SIGKILL); the
    reaper sends the task again once the retry is overdue. It must send the *retry* (its new
    arguments, ``retries`` + 1), not the call of the run that retried: that run's work is done."""
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    result = app.retry_with_cursor.delay(0, 3)
    cluster.wait_runs(result.id, 1)
    wait_until(lambda: lease(cluster, result.id).get("status") == "RETRYING", 10, "the retry")
    wait_until(lambda: "retry: Retry in 3s" in w1.log(), 10, "the retry message sent")
    wait_until(lambda: w1.log().count(f"[{result.id}] received") == 2, 10, "the retry received")
    w1.signal_group(signal.SIGKILL)  # the retry message dies in w1's eta timer
    w1.proc.wait(timeout=10)
    cluster.worker("w2", concurrency=1)
    assert result.get(timeout=40) == "cursor 1 after 1 retries"
    runs = cluster.runs(result.id)
    assert [(run["cursor"], run["retries"]) for run in runs] == [(0, 0), (1, 1)], runs


def test_a_process_lost_with_reject_on_worker_lost_is_taken_over_at_once(cluster: Cluster) -> None:
    """``task_acks_late`` + ``task_reject_on_worker_lost``: Celery stores no ``WorkerLostError``
    for a lost process, it puts the message back. The lease still lapses at once, and the
    message put back (or the reaper's re-send) runs the task, without waiting for the TTL."""
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, task_acks_late=True, task_reject_on_worker_lost=True)
    result = app.killed_once.delay()
    [first] = cluster.wait_runs(result.id, 1)
    killed_at = time.monotonic()
    os.kill(first["pid"], signal.SIGKILL)
    runs = cluster.wait_runs(result.id, 2, timeout=10)
    assert result.get(timeout=10) == f"finished by {runs[1]['pid']}"
    took = time.monotonic() - killed_at
    assert took < 2.5, f"takeover after SIGKILL took {took:.2f}s (the TTL is 3s: it must not wait for it)"
    assert len(cluster.runs(result.id)) == 2
    assert "WorkerLostError" not in str(stored(cluster, result.id))
    assert "its process was lost: lease given up for a takeover" in worker.log()


@pytest.mark.parametrize(
    ("name", "pool"),
    [
        ("plain_over_time_first_run", "prefork"),
        ("over_time_first_run", "prefork"),
        ("plain_over_time_first_run", "gevent"),
        ("over_time_first_run", "gevent"),
    ],
)
def test_a_hard_time_limit_with_acks_on_timeout_off_runs_the_task_again(cluster: Cluster, name: str, pool: str) -> None:
    """``task_acks_late`` with ``acks_on_failure_or_timeout=False``: Celery stores the hard time
    limit's FAILURE, then puts the message back, and the task runs again: a fenced task too."""
    if pool == "gevent" and CELERY_VERSION < (5, 7):
        pytest.skip("Celery 5.5/5.6's gevent pool leaves a timed-out late-acked message unacknowledged")
    app = cluster.app()
    cluster.worker("w1", pool=pool, concurrency=2)
    result = getattr(app, name).delay()
    cluster.wait_runs(result.id, 2, timeout=20)
    wait_until(lambda: (stored(cluster, result.id) or {}).get("status") == "SUCCESS", 15, "the second run's result")
    meta = stored(cluster, result.id)
    assert meta is not None and meta["result"] == "in time"
    assert len(cluster.runs(result.id)) == 2
    if name == "over_time_first_run":  # the second run's result, with its token
        runs = cluster.runs(result.id)
        assert meta["fence_token"] == runs[1]["token"] > runs[0]["token"]
        assert lease(cluster, result.id)["status"] == "DONE"


@pytest.mark.skipif(CELERY_VERSION < (5, 7), reason="retry_on_worker_lost is Celery 5.7's")
def test_a_retry_on_worker_lost_that_arrives_before_its_retry_is_stored_runs(cluster: Cluster) -> None:
    """Celery's main process sends ``retry_on_worker_lost``'s retry *before* it stores RETRY.
    Paused in between, the retry (no delay) reaches another worker while the lease still
    names the lost process: it must run as the retry (``retries`` 1), not be dropped as a
    duplicate and the task sent again later as its first call (``retries`` 0)."""
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    cluster.worker("w2", concurrency=1)
    result = app.killed_then_retried_at_once.signature()
    result = result.freeze()
    cluster.record.set(f"pause-after-retry:{result.id}", 1)
    app.killed_then_retried_at_once.apply_async(task_id=result.id)
    assert result.get(timeout=30) == "retried 1", w1.log()
    runs = cluster.runs(result.id)
    assert [run["retries"] for run in runs] == [0, 1], runs
