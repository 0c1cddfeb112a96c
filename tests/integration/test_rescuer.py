"""Takeovers that need no free slot in the pool they rescue.

Every process of every worker held by a stalled owner (a downstream outage) must not stop the
takeover: each worker's main process reaps in a thread of its own, and a lost lease frees its
process (``fenced_interrupt_on_loss``, on by default: the test app leaves it so).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.integration.conftest import Cluster, lease, stored

pytestmark = pytest.mark.integration

#: The test app's stage deadline and lease TTL, seconds (see apps/fenced_app.py).
DEADLINE, TTL = 2.0, 3.0


def test_every_process_of_every_worker_stuck_all_tasks_taken_over(cluster: Cluster) -> None:
    app = cluster.app()
    workers = [cluster.worker(name, concurrency=2) for name in ("w1", "w2")]
    cluster.beat()
    started = time.monotonic()
    results = [app.stuck_downstream.delay() for _ in range(4)]
    for result in results:
        cluster.wait_runs(result.id, 1, timeout=10)  # all four processes are now held
    bound = DEADLINE + TTL + 8
    for result in results:
        left = bound - (time.monotonic() - started)
        runs = cluster.wait_runs(result.id, 2, timeout=max(left, 0.1))
        assert result.get(timeout=max(bound - (time.monotonic() - started), 0.1)) == f"owner {runs[1]['token']}"
        assert runs[1]["token"] > runs[0]["token"]
        assert stored(cluster, result.id)["fence_token"] == runs[1]["token"]  # type: ignore[index]
        assert lease(cluster, result.id)["status"] == "DONE"
        assert cluster.record.lrange(f"interrupted:{result.id}", 0, -1) in (
            ["LeaseInterrupted"],
            ["_AsyncLeaseInterrupted"],
        )
    for result in results:  # three reapers (two workers' threads and beat's own pass) re-sent each task once
        assert len(cluster.runs(result.id)) == 2
        assert lease(cluster, result.id)["takeovers"] == "1"
    for worker in workers:
        assert "Task celery_fenced.reap[" not in worker.log(), "the reaper's own runs fill no log lines"


def test_without_beat_a_frozen_owner_is_taken_over_by_the_worker_itself(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2)
    result = app.zombie_once.delay("frozen")
    [first] = cluster.wait_runs(result.id, 1)
    os.kill(first["pid"], signal.SIGSTOP)  # no heartbeat, no lapse, no reap message, and no beat
    try:
        runs = cluster.wait_runs(result.id, 2, timeout=TTL + 10)
        assert result.get(timeout=10) == f"owner {runs[1]['token']} frozen"
        assert "takeover: task" in worker.log() and "cause=gone" in worker.log()
    finally:
        os.kill(first["pid"], signal.SIGCONT)
        cluster.wake(result.id)
