"""The gevent pool on real workers: a stuck greenlet, a blocked hub, many greenlets, and
takeovers between a gevent and a prefork worker.

Times are the app's: lease TTL 3 s, heartbeat 0.5 s, stage deadline 2 s. Every test asserts
on what was stored: one SUCCESS per task id, written by the token of its last run.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import Cluster, lease, stored
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration


def stored_once_by_the_last_run(cluster: Cluster, task_id: str) -> dict[str, Any]:
    """The task's result: SUCCESS, by the token of its last run; its lease DONE."""
    runs = cluster.runs(task_id)
    meta = stored(cluster, task_id)
    assert meta is not None and meta["status"] == "SUCCESS", meta
    assert meta["fence_token"] == runs[-1]["token"], (meta, runs)
    assert lease(cluster, task_id)["status"] == "DONE"
    return meta


def test_a_greenlet_stuck_in_a_socket_read_is_interrupted_and_its_slot_runs_the_takeover(cluster: Cluster) -> None:
    app = cluster.app()
    # One greenlet: the re-sent task can only run once the stuck one's slot is free again.
    worker = cluster.worker("w1", pool="gevent", concurrency=1)
    result = app.stuck_downstream.delay()  # blocks in a Redis BLPOP with no timeout
    [first] = cluster.wait_runs(result.id, 1)
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    assert result.get(timeout=10) == f"owner {runs[1]['token']}"
    took = runs[1]["started"] - first["started"]
    # the stage deadline (2 s) + the TTL (3 s) + a reaper interval and a re-send
    assert took < 2 + 3 + 4, f"the stuck greenlet's task was run again after {took:.1f}s"
    assert runs[1]["pid"] == first["pid"] and runs[1]["token"] > first["token"]
    interrupted = wait_until(lambda: cluster.record.lrange(f"interrupted:{result.id}", 0, -1), 10, "the interrupt")
    assert interrupted == ["LeaseInterrupted"]
    assert "thrown into its greenlet" in worker.log()
    stored_once_by_the_last_run(cluster, result.id)


def test_a_hub_blocked_by_code_that_never_yields_loses_every_lease_and_each_task_ends_elsewhere(
    cluster: Cluster,
) -> None:
    app = cluster.app()
    blocked = cluster.worker("w1", pool="gevent", concurrency=4)
    hog = app.hogs_the_hub.delay(20)
    others = [app.socket_waits.delay(30, 0.2) for _ in range(3)]  # 6 s each, progress every 0.2 s
    for result in (hog, *others):
        cluster.wait_runs(result.id, 1)
    # Only now a second worker, so that the first runs were all the gevent worker's.
    cluster.worker("w2", pool="prefork", concurrency=4)
    cluster.wake(hog.id)  # the hog blocks the hub for 20 s
    assert hog.get(timeout=30) == f"owner {cluster.runs(hog.id)[-1]['token']}"
    for result in others:
        assert result.get(timeout=30) == f"waited by {cluster.runs(result.id)[-1]['token']}"
    for result in (hog, *others):
        runs = cluster.runs(result.id)
        assert [run["hostname"].split("@")[0] for run in runs] == ["w1", "w2"], runs
        stored_once_by_the_last_run(cluster, result.id)
    # The hub runs again: each of its stale owners finds its lease lost and stores nothing.
    wait_until(
        lambda: all(f"[{result.id}] ignored" in blocked.log() for result in (hog, *others)),
        30,
        "the gevent worker's four attempts to end as lost owners",
    )
    for result in (hog, *others):
        stored_once_by_the_last_run(cluster, result.id)
        assert len(cluster.runs(result.id)) == 2


def test_two_hundred_greenlets_with_one_stuck_only_that_one_is_taken_over(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", pool="gevent", concurrency=200)
    stuck = app.stuck_downstream.delay()
    cluster.wait_runs(stuck.id, 1)
    healthy = [app.socket_waits.delay(16, 0.5) for _ in range(199)]  # 8 s each, all at once
    assert stuck.get(timeout=30).startswith("owner ")
    for result in healthy:
        assert result.get(timeout=60).startswith("waited by ")
    runs = [run for result in healthy for run in cluster.runs(result.id)]
    assert len(runs) == 199  # each ran once
    started = [run["started"] for run in runs]
    # Side by side: every wait started before the first one ended (one after the other, they
    # would take 199 x 8 s). Starting 199 greenlets is CPU work, so the body is long enough
    # that a busy machine still starts them all within it.
    assert max(started) - min(started) < 8, "the 199 waits did not run side by side"
    for result in healthy:
        assert lease(cluster, result.id)["takeovers"] == "0"
        stored_once_by_the_last_run(cluster, result.id)
    first, second = cluster.runs(stuck.id)
    assert second["token"] > first["token"] and second["attempt"] == 2
    stored_once_by_the_last_run(cluster, stuck.id)


@pytest.mark.parametrize(("first_pool", "then_pool"), [("gevent", "prefork"), ("prefork", "gevent")])
def test_a_task_stalled_on_one_pool_is_taken_over_on_the_other(
    cluster: Cluster, first_pool: str, then_pool: str
) -> None:
    app = cluster.app()
    # One slot, not interrupted: the zombie keeps it, so the takeover runs on the other worker.
    first = cluster.worker("w1", pool=first_pool, concurrency=1)
    result = app.zombie_once.delay(first_pool)
    cluster.wait_runs(result.id, 1)
    cluster.worker("w2", pool=then_pool, concurrency=1)
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    assert result.get(timeout=10) == f"owner {runs[1]['token']} {first_pool}"
    assert [run["hostname"].split("@")[0] for run in runs] == ["w1", "w2"]
    cluster.wake(result.id)  # the zombie returns: its write is refused
    wait_until(lambda: "stale write dropped" in first.log(), 15, "the zombie's write to be refused")
    meta = stored_once_by_the_last_run(cluster, result.id)
    assert meta["result"] == f"owner {runs[1]['token']} {first_pool}"
