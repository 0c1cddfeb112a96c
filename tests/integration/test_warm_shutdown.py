"""A warm shutdown on real workers: the running task finishes where it runs, under its lease.

docs/guarantees.rst, "A body that never finished": a worker told to stop (SIGTERM) lets its
running bodies end, and their leases are renewed until they do.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.integration.apps.fenced_app import SLOW_HEARTBEAT
from tests.integration.conftest import APP, ROOT, Cluster, lease
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration

#: Prints whether a worker stops the package's bootstep before its pool (the order is the
#: same for every pool: it is made before the pool is).
_ORDER = f"""
from celery.worker import WorkController
from {APP} import app
worker = WorkController(app=app, pool_cls="threads", concurrency=2, without_mingle=True, without_gossip=True)
names = [step.name.rsplit(".", 1)[-1] for step in worker.blueprint.order]
print(names.index("FencedWorkerStep") > names.index("Pool"))
"""


def seed_that_stops_the_step_before_the_pool() -> str:
    """A ``PYTHONHASHSEED`` under which Celery orders the package's worker bootstep after the
    pool (Celery orders steps that require none as a set iterates), so it is stopped first."""
    for seed in range(40):
        env = {**os.environ, "PYTHONHASHSEED": str(seed), "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", _ORDER], env=env, capture_output=True, text=True, timeout=60, check=True
        )
        if done.stdout.strip().endswith("True"):
            return str(seed)
    raise AssertionError("no seed orders the step after the pool")


@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_a_warm_shutdown_renews_the_leases_of_the_bodies_it_waits_for(cluster: Cluster, pool: str) -> None:
    cluster.settings = {"fenced_lease_ttl": 2, "fenced_heartbeat_interval": 0.3}
    app = cluster.app()
    environ = {"PYTHONHASHSEED": seed_that_stops_the_step_before_the_pool()}
    stopping = cluster.worker("w1", pool=pool, concurrency=2, environ=environ)
    result = app.healthy_for.delay(5)
    [first] = cluster.wait_runs(result.id, 1)
    cluster.worker("w2", pool=pool, concurrency=1)
    cluster.beat()
    os.kill(stopping.pid, signal.SIGTERM)  # a deploy stops the worker: it lets the body end
    wait_until(lambda: "Warm shutdown" in stopping.log(), 10, "the warm shutdown")
    assert result.get(timeout=20) == f"healthy by {first['token']}"
    wait_until(lambda: stopping.proc.poll() is not None, 20, "the worker to exit")
    assert len(cluster.runs(result.id)) == 1, cluster.runs(result.id)
    assert lease(cluster, result.id)["status"] == "DONE"


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_a_warm_shutdown_publishes_the_latest_details_before_the_worker_is_killed(cluster: Cluster, pool: str) -> None:
    """A rolling restart: SIGTERM, then SIGKILL once the grace runs out. The body reported its
    batches far faster than its heartbeat renews (docs/resuming.rst): the stop publishes them,
    so the next owner resumes after the last one instead of from an older checkpoint."""
    app = cluster.app()
    stopping = cluster.worker("w1", pool=pool, concurrency=1)
    result = app.reported_then_busy.delay(7)
    [first] = cluster.wait_runs(result.id, 1)
    wait_until(lambda: cluster.record.llen(f"reported:{result.id}") == 7, 10, "seven batches reported")
    assert json.loads(lease(cluster, result.id).get("details") or "{}").get("done") != 7  # not renewed since
    os.kill(stopping.pid, signal.SIGTERM)  # the main process only, as a container runtime sends it
    # Well within the grace, and long before the next renewal (SLOW_HEARTBEAT): the stop publishes.
    wait_until(
        lambda: json.loads(lease(cluster, result.id).get("details") or "{}") == {"done": 7},
        SLOW_HEARTBEAT / 2,
        "the stopping worker to publish the last details",
    )
    assert stopping.proc.poll() is None  # still waiting for its body
    stopping.signal_group(signal.SIGKILL)  # the grace ran out
    wait_until(lambda: stopping.proc.poll() is not None, 10, "the worker to die")
    cluster.worker("w2", pool=pool, concurrency=1)
    # Taken over once the lease TTL from its last renewal runs out, at the next reaper pass.
    runs = cluster.wait_runs(result.id, 2, timeout=2 * SLOW_HEARTBEAT + 1 + 20)
    assert runs[1]["checkpoint"] == ["process", {"done": 7}, 1, first["token"]]
    assert result.get(timeout=10) == "resumed after batch 7"
