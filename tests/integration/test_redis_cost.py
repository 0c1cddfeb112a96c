"""What the lease costs Redis per task, counted by the server itself (``INFO commandstats``)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import Cluster, stored
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration

#: Tasks per side: enough that one script call more per task stands far above the few calls a
#: worker makes of its own (its start, its liveness) while it runs them.
TASKS = 30

#: A worker whose heartbeat and reaper stay quiet while the tasks run (each task ends well
#: within one tick), so that the server's count is the tasks' own.
QUIET = {"fenced_lease_ttl": 60, "fenced_heartbeat_interval": 20, "fenced_reaper_interval": 3600}


def script_calls(cluster: Cluster) -> int:
    """Script calls the server ran since its statistics were last reset."""
    with cluster.server.client() as client:
        stats: dict[str, Any] = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval"))


def calls_per_side(cluster: Cluster, app: Any, track_started: bool) -> int:
    worker = cluster.worker(f"w-{track_started}", concurrency=1, task_track_started=track_started, **QUIET)
    app.noted_add.delay(0, 0).get(timeout=20)  # the worker's first task: its own start is done
    with cluster.server.client() as client:
        client.config_resetstat()
    for n in range(TASKS):
        assert app.noted_add.delay(n, 1).get(timeout=20) == n + 1
    calls = script_calls(cluster)
    worker.stop()
    return calls


def test_task_track_started_costs_no_script_call_more(cluster: Cluster) -> None:
    """The STARTED result ``task_track_started`` asks for is stored by the call that takes the
    lease, not by a script call of its own (issue: the lease's Redis cost)."""
    app = cluster.app()
    off = calls_per_side(cluster, app, track_started=False)
    on = calls_per_side(cluster, app, track_started=True)
    assert off >= 2 * TASKS, f"{off} script calls for {TASKS} tasks: not the tasks' own count"
    assert on - off < TASKS // 3, f"with task_track_started: {on} script calls, without: {off} ({TASKS} tasks)"


def test_a_started_task_shows_started_with_its_runs_token(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=1, task_track_started=True)
    result = app.progress_until_told.delay()
    [run] = cluster.wait_runs(result.id, 1)
    wait_until(lambda: result.state == "STARTED", 10, "the STARTED state")
    meta = stored(cluster, result.id)
    assert meta is not None
    assert meta["status"] == "STARTED" and meta["fence_token"] == run["token"]
    assert meta["result"] == {"pid": run["pid"], "hostname": run["hostname"]}
    assert result.info == {"pid": run["pid"], "hostname": run["hostname"]}
    cluster.wake(result.id)
    assert result.get(timeout=20) == f"told {run['token']}"
