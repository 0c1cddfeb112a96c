"""Where the reap goes: beat's pass and a heartbeat's request reach a fenced worker whatever the
user's ``task_routes`` and queues, and no reap message ever waits in a queue."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_fenced._celery.compat import CELERY_VERSION
from tests.integration.conftest import BROKER_DB, Cluster, rabbitmq_url
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration

APP_TASKS = "tests.integration.apps.fenced_app"

#: The user's routing: every task of the app to the "cpu" queue; nothing consumes "celery".
ROUTED = {"task_routes": {f"{APP_TASKS}.*": {"queue": "cpu"}}}

#: The workers' own reaper threads pass every ten minutes (after a random first wait): a
#: takeover within seconds comes from beat's pass or from the heartbeat's request.
SLOW_WORKER_PASSES = {"fenced_reaper_interval": 600}

REAP = "celery_fenced.reap"


def reap_messages_in_lists(cluster: Cluster) -> dict[str, int]:
    """How many ``celery_fenced.reap`` messages each list of the Redis broker holds."""
    found: dict[str, int] = {}
    with redis.Redis.from_url(cluster.server.url(BROKER_DB)) as client:
        for key in client.scan_iter(_type="list"):
            count = sum(REAP.encode() in message for message in client.lrange(key, 0, -1))
            if count:
                found[key.decode()] = count
    return found


def redis_broker_only() -> None:
    if rabbitmq_url() is not None:
        pytest.skip("reads the Redis broker's lists")


@pytest.fixture
def routed(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster with the user's routing (its app in this process too, until the test ends)."""
    redis_broker_only()
    cluster.settings.update(ROUTED)
    yield cluster
    # The app of this process is every test's: an update (not an assignment) builds its router again.
    cluster.app().app.conf.update(task_routes=None)


def test_beat_reaps_in_its_own_process_whatever_the_routing(routed: Cluster) -> None:
    cluster = routed
    app = cluster.app()
    beat = cluster.beat(loglevel="DEBUG")  # beat's pass every second (the app's reaper interval)
    # An owner that is gone: its lease expires at once, and only a reaper brings the task back.
    task_id = str(uuid.uuid4())
    store = app.app.backend.lease_store
    call = {"task": f"{APP_TASKS}.steady", "args": [1, 0.01], "kwargs": {}, "options": {}}
    store.acquire(task_id, "gone@nowhere/1/a", ttl_ms=100, task_name=f"{APP_TASKS}.steady", max_takeovers=3, call=call)
    wait_until(lambda: "re-sent (cause=gone" in beat.log(), 10, "beat's own pass to take the task over")
    worker = cluster.worker("w1", queues="cpu", **SLOW_WORKER_PASSES)
    runs = cluster.wait_runs(task_id, 1, timeout=10)
    assert runs[0]["hostname"].startswith("w1@")
    wait_until(lambda: beat.log().count("Sending due task celery_fenced.reap") >= 5, 20, "five ticks of beat")
    assert reap_messages_in_lists(cluster) == {}
    assert f"{REAP}[" not in worker.log()
    assert "ERROR" not in beat.log()


def test_a_stalled_owner_is_taken_over_at_once_whatever_the_routing(routed: Cluster) -> None:
    cluster = routed
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, queues="cpu", **SLOW_WORKER_PASSES)
    result = app.zombie_once.delay("x")
    first, second = cluster.wait_runs(result.id, 2, timeout=15)
    # The stage's deadline (2 s), fenced_stall_checks (2) heartbeat ticks (0.5 s), one tick of
    # alignment: the heartbeat gives the lease up and the reap it asks for runs at once.
    allowed = 2 + 2 * 0.5 + 0.5 + 1.5
    assert second["started"] - first["started"] < allowed, (first, second)
    assert second["token"] > first["token"]
    assert result.get(timeout=10) == f"owner {second['token']} x"
    cluster.wake(result.id)
    wait_until(lambda: "stale write dropped" in worker.log(), 15, "the zombie's write to be refused")
    assert reap_messages_in_lists(cluster) == {}
    assert f"{REAP}[" not in worker.log()  # no "Discarding revoked task: celery_fenced.reap" either


def test_the_reaper_runs_no_task_and_makes_no_span_in_the_workers(cluster: Cluster, tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="needs the extra 'otel' and the SDK")
    pytest.importorskip("opentelemetry.instrumentation.celery", reason="needs opentelemetry-instrumentation-celery")
    trace_file = tmp_path / "spans.jsonl"
    app = cluster.app()
    worker = cluster.worker("w1", environ={"FENCED_TEST_TRACE_FILE": str(trace_file)})
    beat = cluster.beat(loglevel="DEBUG")
    wait_until(lambda: beat.log().count("Sending due task celery_fenced.reap") >= 5, 20, "five ticks of beat")
    result = app.steady.delay(1, 0.01)
    assert result.get(timeout=15).startswith("done by")

    def span_names() -> list[str]:
        lines = trace_file.read_text(encoding="utf-8").splitlines() if trace_file.exists() else []
        return [json.loads(line)["name"] for line in lines if line.strip()]

    wait_until(lambda: f"run/{APP_TASKS}.steady" in span_names(), 10, "the task's run span")
    assert f"run/{REAP}" not in span_names()
    assert f"{REAP}[" not in worker.log()


def test_a_re_send_parked_behind_its_stalled_owner_is_passed_on_to_a_worker_that_can_start_it(
    cluster: Cluster,
) -> None:
    redis_broker_only()
    if CELERY_VERSION < (5, 6):
        pytest.skip("w2 takes a message only when a process is free: worker_disable_prefetch (Celery 5.6)")
    app = cluster.app()
    # w1 has Celery's default prefetch: room for four messages beside its one busy process.
    w1 = cluster.worker("w1", concurrency=1, worker_disable_prefetch=False, worker_prefetch_multiplier=4)
    w2 = cluster.worker("w2", concurrency=1, queues="celery,side", worker_disable_prefetch=True)
    busy = app.steady.apply_async((16, 0.5), queue="side")  # w2's only process, for eight seconds
    cluster.wait_runs(busy.id, 1)
    result = app.zombie_once.delay("x")  # w2 takes nothing while busy: w1 runs it, and stalls
    [first] = cluster.wait_runs(result.id, 1)
    assert first["hostname"].startswith("w1@")
    # The takeover's re-send comes while w2 is still busy: only w1 takes it, behind its own
    # stalled owner. It must not wait there: w2 starts it once free.
    wait_until(lambda: w1.log().count(f"zombie_once[{result.id}] received") >= 2, 15, "w1 to receive the re-send")
    assert busy.get(timeout=20).startswith("done by")
    runs = cluster.wait_runs(result.id, 2, timeout=10)
    assert runs[1]["hostname"].startswith("w2@")
    assert result.get(timeout=10) == f"owner {runs[1]['token']} x"
    cluster.wake(result.id)  # the old owner's late write meets a newer token: refused
    wait_until(lambda: "stale write dropped" in w1.log(), 15, "the zombie's write to be refused")
    assert "passed on, for a worker that can start it" in w1.log()
    assert len(cluster.runs(result.id)) == 2
    assert "Traceback" not in w2.log()
