"""What an operator sees and types: dead letters, unknown ids, bad settings, one line each.

Every command runs as a user runs it (``celery -A app …`` in its own process).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import redis

from celery_fenced._telemetry.metrics import ClusterCollector
from celery_fenced.harness import free_port
from tests.integration.conftest import APP, KEYS, Cluster, lease, rabbitmq_url, stored
from tests.support.processes import wait_until

#: A call the reaper sends again: to a queue no worker of these tests consumes.
CALL = {"task": "proj.report", "args": [], "kwargs": {}, "options": {"queue": "reports"}}

pytestmark = pytest.mark.integration


def abandoned_gauge(cluster: Cluster) -> float:
    app = cluster.app().app
    [family] = [f for f in ClusterCollector(app.backend.lease_store).collect() if f.name == "owner_abandoned_tasks"]
    return float(family.samples[0].value)


def test_dead_letters_are_listed_counted_and_redriven_at_once(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=2, fenced_max_takeovers=0)
    results = [app.zombie_once.delay(f"dl{i}") for i in range(2)]
    for result in results:
        wait_until(lambda r=result: lease(cluster, r.id).get("status") == "ABANDONED", 20, "ABANDONED")
        cluster.wake(result.id)
    ids = {result.id for result in results}
    assert not ids & set(cluster.cli("status").stdout.split())  # not live
    listed = cluster.cli("status", "--state", "abandoned")
    assert listed.returncode == 0, listed.stderr
    rows = [line for line in listed.stdout.splitlines() if line.split()[:1] and line.split()[0] in ids]
    assert len(rows) == 2 and all(" ABANDONED " in row for row in rows)
    assert listed.stdout.strip().endswith("2 lease(s)")
    as_json = json.loads(cluster.cli("status", "--state", "ABANDONED", "--json").stdout)
    assert {row["task_id"] for row in as_json} == ids and all(row["status"] == "ABANDONED" for row in as_json)
    assert set(cluster.cli("status", "--all").stdout.split()) >= ids
    assert abandoned_gauge(cluster) == 2
    for result in results:
        cluster.results.hset(KEYS.lease(result.id), "maxTakeovers", 3)  # the operator raised the limit
    redriven = cluster.cli("redrive", "--all-abandoned")
    assert redriven.returncode == 0, redriven.stderr
    assert sorted(redriven.stdout.split()) == sorted([f"{i}:" for i in ids] + ["redriven"] * 2)
    for result in results:
        assert result.get(timeout=20).startswith("owner ")
    assert cluster.cli("status", "--state", "ABANDONED").stdout.strip().endswith("0 lease(s)")
    assert abandoned_gauge(cluster) == 0


@pytest.mark.parametrize("command", ["cancel", "redrive", "inspect"])
def test_an_unknown_task_id_is_an_error_that_stores_nothing(cluster: Cluster, command: str) -> None:
    cluster.app()
    done = cluster.cli(command, "no-such-task")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-task" in lines[0] and lines[0].startswith("Error: "), done.stderr
    assert cluster.results.keys("*no-such-task*") == []


def test_cancel_force_cancels_a_task_before_it_starts(cluster: Cluster) -> None:
    app = cluster.app()
    task_id = "queued-not-started"
    assert cluster.cli("cancel", "--force", task_id).stdout.strip() == f"{task_id}: cancelled"
    cluster.worker("w1", concurrency=1)
    result = app.steady.apply_async((1, 0.0), task_id=task_id)
    with pytest.raises(Exception, match="cancelled"):
        result.get(timeout=15)
    assert stored(cluster, task_id)["status"] == "REVOKED"  # type: ignore[index]
    assert cluster.runs(task_id) == []


def run_celery(cluster: Cluster, argv: list[str], timeout: float = 30, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A app ARGV`` to its end (a bad setting must end it)."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, *argv],
        env={**cluster.env(), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "argv", [["worker", "-P", "solo", "-l", "INFO"], ["beat", "-l", "INFO", "-s", "/dev/null"], ["fenced", "status"]]
)
def test_a_bad_setting_stops_worker_beat_and_cli_with_one_line(cluster: Cluster, argv: list[str]) -> None:
    cluster.settings = {"fenced_on_stall": "relase"}
    done = run_celery(cluster, argv)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Traceback" not in output, output
    [line] = [line for line in output.splitlines() if "relase" in line]
    assert "fenced_on_stall must be one of release, expire, alert; got 'relase'" in line
    assert len(output.splitlines()) < 20, output


@pytest.mark.parametrize("argv", [["worker", "-P", "solo"], ["fenced", "status"]])
def test_a_fenced_url_that_is_not_redis_is_refused(cluster: Cluster, argv: list[str]) -> None:
    done = run_celery(cluster, argv, FENCED_TEST_BACKEND_URL="fenced+amqp://127.0.0.1:5672/3")
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in output, output
    [line] = [line for line in output.splitlines() if "fenced+amqp" in line]
    assert "is not a Redis URL" in line and "fenced+redis://" in line


def test_misspelled_settings_and_stages_are_warned_with_the_nearest_name(cluster: Cluster) -> None:
    cluster.settings = {"fenced_stage_timeout": {"load-data": 5}}
    worker = cluster.worker("w1", concurrency=1)
    [line] = [line for line in worker.log().splitlines() if "unknown setting fenced_stage_timeout:" in line]
    assert "celery-fenced has no such setting (did you mean fenced_stage_timeouts?)" in line
    assert "WARNING/" in line, "logged through the worker's logging, with its level"
    assert ".> results:     fenced+redis://127.0.0.1:" in worker.log(), "the banner names the fenced backend"
    status = cluster.cli("status")
    [line] = [line for line in status.stderr.splitlines() if "unknown setting" in line]
    assert line.startswith("WARNING celery_fenced.conf: ") and "did you mean fenced_stage_timeouts?" in line


def test_a_worker_that_cannot_reach_its_lease_redis_says_so(cluster: Cluster) -> None:
    port = free_port()
    unreachable = f"fenced+redis://127.0.0.1:{port}/1"
    log = cluster.worker("w1", concurrency=1, environ={"FENCED_TEST_BACKEND_URL": unreachable}).log()
    assert f"the lease Redis fenced+redis://127.0.0.1:{port}/1 cannot be reached" in log
    assert log.index("cannot be reached") < log.index(" ready.")


def test_beat_reaps_every_tick_in_its_own_process_without_an_info_line_for_each(cluster: Cluster) -> None:
    if rabbitmq_url():
        pytest.skip("reads the Redis broker's lists")
    app = cluster.app()
    beat = cluster.beat()  # -l INFO
    store = app.app.backend.lease_store
    # Two owners gone, one after the other: each is taken over by one of beat's ticks.
    for task_id in ("gone-1", "gone-2"):
        store.acquire(task_id, "gone@nowhere/1/a", ttl_ms=100, task_name="proj.report", max_takeovers=3, call=CALL)
        wait_until(
            lambda task_id=task_id: lease(cluster, task_id).get("status") == "REQUEUED",
            10,
            f"beat to take {task_id} over",
        )
    assert beat.log().count("re-sent (cause=gone") == 2
    broker = redis.Redis.from_url(cluster.broker_url)
    assert broker.llen("celery") == 0  # beat sent no reap message: only the two re-sent tasks went to their queue
    assert broker.llen("reports") == 2
    log = beat.log()
    assert "beat: Starting" in log
    assert "Sending due task celery_fenced.reap" not in log, log
    broker.close()


def metric_fields(cluster: Cluster) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in cluster.results.hgetall(KEYS.metrics).items()}


def test_a_frozen_owners_late_success_is_no_false_takeover_and_tune_shows_the_tasks_own_deadline(
    cluster: Cluster,
) -> None:
    """SIGSTOP, then SIGCONT once another worker finished the task: the thawed owner stores
    its SUCCESS, refused. It did nothing between its last progress and its thaw (its heartbeat
    was silent), so the takeover was right: not a false one, whatever it did after."""
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    result = app.long_call.delay()
    wait_until(lambda: cluster.record.llen(f"waiting:{result.id}") == 1, 20, "the first owner to wait")
    cluster.worker("w2", concurrency=1)
    w1.signal_group(signal.SIGSTOP)  # heartbeat and body frozen together
    try:
        runs = cluster.wait_runs(result.id, 2, timeout=30)  # taken over once its lease expired
        assert result.get(timeout=20) == f"owner {runs[1]['token']}"
        cluster.wake(result.id)  # the first body returns as soon as it runs again
    finally:
        w1.signal_group(signal.SIGCONT)
    wait_until(lambda: "stale write dropped" in w1.log(), 15, "the thawed owner's SUCCESS to be refused")
    # Its refused write is counted, and flushed, with the false takeover it would be.
    wait_until(lambda: metric_fields(cluster).get("owner_fencing_rejected_total|"), 15, "the refusal to be counted")
    assert not [field for field in metric_fields(cluster) if field.startswith("owner_false_takeover_total")]

    def tune_row() -> list[str] | None:
        # Each owner's stage sample reaches Redis with its process's next metrics flush, which
        # may come after the refusal's (a busy machine): tune shows the stage once one has.
        tune = cluster.cli("tune", "--min-samples", "1")
        assert tune.returncode == 0, tune.stderr
        rows = [r.split() for r in tune.stdout.splitlines()]
        return next((r for r in rows if r[:2] == [f"{APP}.long_call", "call-api"]), None)

    row = wait_until(tune_row, 15, "tune to show the stage's samples")
    assert row[5] == "0", row  # FALSE TAKEOVERS
    assert row[6] == "120s", row  # CURRENT: the task's own deadline, not the app's 2 s default
