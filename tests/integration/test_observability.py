"""Watching it: the ``celery fenced`` command, cluster-wide metrics and Flower, all real processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import redis

from celery_fenced.harness import free_port
from tests.integration.conftest import APP, KEYS, Cluster, lease, stored, zombie_scenario
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.integration


def start_flower(cluster: Cluster) -> tuple[CeleryProcess, str]:
    """``celery fenced flower`` on a free port, ready and listening to events; the process and
    its base URL.

    Flower prints its "Visit me at" banner before its event receiver connects: a worker
    started right after could send its first task's events before anyone listens (events are
    not kept for a late listener). Ready here means Flower has subscribed to the events
    exchange, the only subscriber on the test's Redis before its workers start.
    """
    port = free_port()
    cluster.app()
    with cluster.server.client() as client:
        before = listeners(client)
        flower = cluster.command(
            "flower",
            ["fenced", "flower", f"--port={port}", "--address=127.0.0.1"],
            "Visit me at",
            FLOWER_UNAUTHENTICATED_API="true",
        )
        wait_until(lambda: listeners(client) > before, 20, "Flower's event receiver to subscribe")
    return flower, f"http://127.0.0.1:{port}"


def listeners(client: redis.Redis) -> int:
    """Subscriptions on the Redis broker: patterns and channels (kombu's fanout exchanges)."""
    channels = client.execute_command("PUBSUB", "CHANNELS")
    return int(client.execute_command("PUBSUB", "NUMPAT")) + len(channels)


def test_every_subcommand_answers_help(cluster: Cluster) -> None:
    for sub in ("status", "inspect", "cancel", "redrive", "metrics", "tune", "flower"):
        done = cluster.cli(sub, "--help")
        assert done.returncode == 0, done.stderr
        assert f"celery fenced {sub} [OPTIONS]" in done.stdout


def test_status_inspect_cancel_and_tune(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.progress_until_told.delay()
    wait_until(lambda: cluster.runs(result.id), 10, "the task to start")
    wait_until(lambda: result.id in cluster.cli("status").stdout, 10, "the lease in the status table")
    status = cluster.cli("status").stdout
    header, row = status.splitlines()[0], next(line for line in status.splitlines() if result.id in line)
    for column in ("TASK ID", "NAME", "OWNER", "TOKEN", "STAGE", "SINCE PROGRESS", "LEFT", "ATTEMPT"):
        assert column in header
    assert "RUNNING" in row and "load-data" in row and "w1@" in row
    [as_json] = json.loads(cluster.cli("status", "--json").stdout)
    token = int(cluster.results.get(KEYS.token))  # type: ignore[arg-type]  # the one handed out
    assert as_json["task_id"] == result.id and as_json["token"] == token and as_json["seconds_left"] > 0
    wait_until(lambda: lease(cluster, result.id).get("details"), 10, "the first details to be published")
    inspected = json.loads(cluster.cli("inspect", "--json", result.id).stdout)
    assert inspected["status"] == "RUNNING" and inspected["ownerToken"] == token
    assert inspected["details"]["note"] == "é" and inspected["details"]["polls"] >= 1
    assert inspected["call"]["task"] == "tests.integration.apps.fenced_app.progress_until_told"
    readable = cluster.cli("inspect", result.id).stdout
    assert re.search(rf"^  ownerToken +{token}  \(the owner's\)$", readable, re.M), readable
    assert re.search(r'^  details +\{"note": "é", "polls": \d+\}$', readable, re.M), readable
    assert re.search(r"^  lastProgressAt +20\d\d-\d\d-\d\dT[0-9:.]+Z \(\d+\.\ds ago\)$", readable, re.M), readable
    assert "  call:\n    tests.integration.apps.fenced_app.progress_until_told(\n    )" in readable, readable
    assert cluster.cli("cancel", result.id).stdout.strip() == f"{result.id}: cancelled"
    wait_until(lambda: json.loads(cluster.cli("inspect", "--json", result.id).stdout)["status"] == "DONE", 10, "DONE")
    cancelled = json.loads(cluster.cli("inspect", "--json", result.id).stdout)
    assert cancelled["ownerToken"] == token and cancelled["cancelToken"] > token  # the owner's, and the cancel's
    assert cluster.cli("redrive", result.id).returncode == 1  # not abandoned
    for _ in range(3):
        app.steady.delay(5, 0.3).get(timeout=15)  # 1.5 s in load-data, 0.3 s between progress calls

    def load_data_samples() -> int:  # each worker adds its samples at its next heartbeat tick
        counts = cluster.results.hgetall(KEYS.gaps)
        return sum(
            int(count) for field, count in counts.items() if field.startswith(f"{APP}.steady|load-data|".encode())
        )

    wait_until(lambda: load_data_samples() >= 3, 10, "the third run's gap sample to be flushed")
    tune = cluster.cli("tune", "--floor", "0.1", "--factor", "2", "--min-samples", "3")
    assert tune.returncode == 0, tune.stderr
    lines = tune.stdout.splitlines()
    header, row = lines[0], next(r for r in lines if r.split()[:2] == [f"{APP}.steady", "load-data"])
    assert "TASK" in header and "SAMPLES" in header and "P99 GAP" in header and "SUGGESTED" in header
    assert row.split()[2] == "3", row  # three runs, one visit of the stage each
    assert row.split()[6] == "2s", row  # CURRENT: the app's table, as the task has none
    gap = float(row.split()[3].rstrip("s"))
    assert 0.3 <= gap < 0.6, row  # the longest gap between progress calls, not the 1.5 s in the stage
    suggested = json.loads(tune.stdout.strip().splitlines()[-1].split("=", 1)[1])
    assert suggested["load-data"] == pytest.approx(2 * gap, abs=0.1)
    few = cluster.cli("tune", "--min-samples", "30")
    assert f"warning: stage 'load-data' of {APP}.steady has 3 sample(s), fewer than 30: no suggestion" in few.stderr
    assert few.stdout.strip().splitlines()[-1].startswith("no suggestion: no stage has enough samples yet")


def test_metrics_are_cluster_wide_and_show_what_happened(cluster: Cluster) -> None:
    zombie_scenario(cluster)
    port = free_port()
    cluster.command("metrics", ["fenced", "metrics", "--port", str(port)], "celery-fenced metrics on")

    def scrape() -> str:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text

    def value(text: str, sample: str) -> float:
        match = re.search(rf"^{re.escape(sample)} ([0-9.e+-]+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def all_counted() -> str | None:  # each worker adds its counts at its next heartbeat tick
        text = scrape()
        seen = (
            value(text, "owner_fencing_rejected_total") >= 1  # the zombie's worker (w1)
            and value(text, "owner_no_progress_timeout_total") >= 1
            and value(text, 'owner_takeover_total{cause="stalled"}') >= 1  # a reaper
            and value(text, "owner_task_total_duration_seconds_count") >= 1  # the new owner's (w2)
        )
        return text if seen else None

    text = wait_until(all_counted, 15, "the refused write, the stall, the takeover and the success to be counted")
    assert value(text, 'owner_takeover_total{cause="stalled"}') == 1
    assert value(text, 'owner_takeover_total{cause="gone"}') == 0
    assert value(text, "owner_fencing_rejected_total") == 1
    # The stalled owner ran on past its deadline, then finished: a false takeover.
    assert value(text, f'owner_false_takeover_total{{stage="load-data",task="{APP}.zombie_once"}}') == 1
    tune = cluster.cli("tune", "--floor", "0.1", "--min-samples", "1")
    row = next(r for r in tune.stdout.splitlines() if r.split()[:2] == [f"{APP}.zombie_once", "load-data"])
    assert "not cut: false takeovers" in row, tune.stdout
    suggested = json.loads(tune.stdout.strip().splitlines()[-1].split("=", 1)[1])
    assert suggested["load-data"] >= 2.0  # the stage's deadline: its quick second run does not cut it
    assert value(text, "owner_no_progress_timeout_total") == 1
    assert value(text, "owner_lease_renew_total") >= 1
    assert value(text, "owner_heartbeat_total") >= 1
    assert value(text, "owner_progress_update_total") >= 2
    assert value(text, "owner_stream_idle_timeout_total") == 0
    assert 'owner_stage_duration_seconds_count{stage="load-data"}' in text or "owner_stage_duration_seconds" in text
    assert value(text, "owner_task_total_duration_seconds_count") == 1
    for name in ("owner_ai_first_token_duration_seconds",):
        assert f"# TYPE {name} histogram" in text


def test_flower_shows_lease_fields_and_ignores_the_zombie(cluster: Cluster) -> None:
    flower, base = start_flower(cluster)
    task_id, runs = zombie_scenario(cluster)

    def info() -> dict:  # type: ignore[type-arg]
        response = httpx.get(f"{base}/api/task/info/{task_id}", timeout=5)
        return response.json() if response.status_code == 200 else {}

    def fenced_events_seen() -> bool:
        metrics = httpx.get(f"{base}/metrics", timeout=5).text
        return 'flower_events_total{task="tests.integration.apps.fenced_app.zombie_once",type="task-fenced"' in metrics

    wait_until(fenced_events_seen, 20, "Flower to receive the zombie's task-fenced event")
    task = info()
    assert task["state"] == "SUCCESS"
    assert task["token"] == runs[1]["token"] and task["attempt"] == 2
    assert task["stage"] == "load-data"
    assert task["worker"].startswith("w2@"), "the zombie's late event flipped the worker back"
    first, second = task["attempts"]
    assert (first["attempt"], first["token"], first["outcome"]) == (1, runs[0]["token"], "write-refused")
    assert first["worker"].startswith("w1@") and first["ended"] >= first["started"]
    assert first["reason"] == f"SUCCESS refused: token {runs[0]['token']}, current {runs[1]['token']}"
    assert (second["attempt"], second["token"], second["outcome"]) == (2, runs[1]["token"], "succeeded")
    assert second["worker"].startswith("w2@") and second["stage"] == "load-data"
    page = httpx.get(f"{base}/task/{task_id}", timeout=5).text
    assert "fenced-attempts" in page and "write-refused" in page and ">Outcome</th>" in page
    listing = httpx.get(f"{base}/api/tasks", timeout=5).json()
    assert listing[task_id]["token"] == runs[1]["token"]
    page = httpx.get(f"{base}/tasks", timeout=5).text
    assert "Stage" in page and "Token" in page and "Takeovers" in page
    assert "Traceback" not in flower.log()


def flower_task(base: str, task_id: str) -> dict:  # type: ignore[type-arg]
    """``/api/task/info/<id>``, or ``{}`` while Flower has not heard of the task."""
    response = httpx.get(f"{base}/api/task/info/{task_id}", timeout=5)
    return response.json() if response.status_code == 200 else {}


def flower_heard(base: str, event_type: str, times: int = 1) -> bool:
    """Flower received ``event_type`` (any task) at least ``times`` times."""
    metrics = httpx.get(f"{base}/metrics", timeout=5).text
    counts = re.findall(rf'^flower_events_total\{{task="[^"]*",type="{event_type}",[^}}]*\}} ([0-9.]+)$', metrics, re.M)
    return sum(float(count) for count in counts) >= times


def outcomes(task: dict) -> list[str]:  # type: ignore[type-arg]
    return [attempt["outcome"] for attempt in task.get("attempts") or []]


def test_flower_shows_a_cancelled_task_as_revoked(cluster: Cluster) -> None:
    _, base = start_flower(cluster)
    app = cluster.app()
    cluster.worker("w1")
    result = app.progress_until_told.delay()
    wait_until(lambda: flower_task(base, result.id).get("token"), 20, "Flower to hear of the running attempt")
    cancelled = cluster.cli("cancel", result.id)
    assert (cancelled.stdout, cancelled.stderr) == (f"{result.id}: cancelled\n", "")
    shown = wait_until(
        lambda: (t := flower_task(base, result.id)).get("state") == "REVOKED" and t, 10, "Flower to show REVOKED"
    )
    assert outcomes(shown) == ["cancelled"]  # type: ignore[arg-type]
    assert shown["attempts"][0]["reason"] == "cancelled (celery fenced cancel)"  # type: ignore[index]
    assert shown["worker"].startswith("w1@")  # type: ignore[index]
    wait_until(lambda: flower_heard(base, "task-lease-lost"), 15, "the owner to tell Flower of its lost lease")
    assert outcomes(flower_task(base, result.id)) == ["cancelled"]
    assert flower_task(base, result.id)["state"] == "REVOKED"


def test_flower_follows_abandon_redrive_and_cancel_at_once(cluster: Cluster) -> None:
    """Each step shows what the backend stores as soon as it is stored, though Celery's order of
    states keeps a FAILURE against a later REVOKED or STARTED."""
    flower, base = start_flower(cluster)
    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    task_id = app.abandoned_then_progresses.delay().id

    def shows(state: str, what: str, timeout: float = 20) -> dict:  # type: ignore[type-arg]
        return wait_until(lambda: (t := flower_task(base, task_id)).get("state") == state and t, timeout, what)  # type: ignore[no-any-return]

    wait_until(lambda: lease(cluster, task_id).get("status") == "ABANDONED", 20, "the task to be abandoned")
    abandoned = shows("FAILURE", "Flower to show the abandoned task's FAILURE")
    assert "TaskAbandonedError" in abandoned["exception"] and outcomes(abandoned) == ["abandoned"]

    cluster.results.hset(KEYS.lease(task_id), "maxTakeovers", 3)  # the operator raised the limit
    redriven = cluster.cli("redrive", task_id)
    assert (redriven.stdout, redriven.stderr) == (f"{task_id}: redriven\n", "")
    left = wait_until(
        lambda: (t := flower_task(base, task_id)).get("state") in ("TAKEOVER", "STARTED") and t,
        10,
        "Flower to leave the FAILURE the redrive removed",
    )
    assert not left.get("exception")  # type: ignore[union-attr]
    running = wait_until(
        lambda: (t := flower_task(base, task_id)).get("state") == "STARTED" and outcomes(t)[-1:] == ["running"] and t,
        20,
        "Flower to show the new attempt running",
    )
    assert outcomes(running) == ["abandoned", "running"]  # type: ignore[arg-type]
    assert running["attempts"][1]["token"] == int(lease(cluster, task_id)["ownerToken"])  # type: ignore[index]

    cancelled = cluster.cli("cancel", task_id)
    assert (cancelled.stdout, cancelled.stderr) == (f"{task_id}: cancelled\n", "")
    revoked = shows("REVOKED", "Flower to show REVOKED", timeout=10)
    assert outcomes(revoked) == ["abandoned", "cancelled"]
    assert stored(cluster, task_id)["status"] == "REVOKED"  # type: ignore[index]

    # The owner learns of it at its next renewal, and the zombie wakes: their news changes nothing.
    wait_until(lambda: cluster.record.llen(f"lost:{task_id}"), 15, "the running owner to learn of the cancel")
    cluster.wake(task_id)
    # Each attempt's lease-lost and refused write: the stalled one's, then the cancelled one's.
    wait_until(lambda: flower_heard(base, "task-fenced", 2), 15, "Flower to hear both refused writes")
    wait_until(lambda: flower_heard(base, "task-lease-lost", 2), 15, "Flower to hear both owners' lost leases")
    final = flower_task(base, task_id)
    assert final["state"] == "REVOKED" and outcomes(final) == ["abandoned", "cancelled"]
    first, second = cluster.runs(task_id)
    shown = [(a["attempt"], a["token"], a["worker"].split("@")[0]) for a in final["attempts"]]
    assert shown == [(1, first["token"], "w1"), (2, second["token"], "w1")]
    assert final["attempts"][0]["reason"] == "takeovers exhausted (stalled)"
    assert final["attempts"][1]["reason"] == "cancelled (celery fenced cancel)"
    assert "Traceback" not in flower.log()


def test_flower_shows_a_task_cancelled_while_nobody_runs_it_as_revoked(cluster: Cluster) -> None:
    _, base = start_flower(cluster)
    app = cluster.app()
    cluster.worker("w1")

    def task(task_id: str) -> dict:  # type: ignore[type-arg]
        response = httpx.get(f"{base}/api/task/info/{task_id}", timeout=5)
        return response.json() if response.status_code == 200 else {}

    quick = app.fenced_add.delay(1, 2)
    assert quick.get(timeout=20) == 3
    wait_until(lambda: task(quick.id).get("state") == "SUCCESS", 20, "Flower to follow the worker's events")
    later = app.fenced_add.apply_async((1, 2), countdown=3600)  # received, waiting for its eta
    wait_until(lambda: task(later.id).get("state") == "RECEIVED", 20, "Flower to show the task received")
    wait_until(lambda: lease(cluster, later.id).get("status") == "RESERVED", 20, "the worker's reservation")
    assert cluster.cli("cancel", later.id).stdout.strip() == f"{later.id}: cancelled"
    wait_until(lambda: task(later.id).get("state") == "REVOKED", 20, "Flower to show REVOKED")
    assert stored(cluster, later.id)["status"] == "REVOKED"  # type: ignore[index]


def test_flower_shows_the_stage_a_task_ended_in(cluster: Cluster) -> None:
    _, base = start_flower(cluster)
    app = cluster.app()
    cluster.worker("w1")
    result = app.ends_in_another_stage.delay()
    assert result.get(timeout=15) == "saved"

    def task() -> dict:  # type: ignore[type-arg]
        response = httpx.get(f"{base}/api/task/info/{result.id}", timeout=5)
        return response.json() if response.status_code == 200 else {}

    shown = wait_until(lambda: (t := task()).get("stage") == "persist-result" and t, 15, "the last stage in Flower")
    assert shown["state"] == "SUCCESS" and shown["details"] == {"rows": 3, "saved": True}  # type: ignore[index]
    assert [a["outcome"] for a in shown["attempts"]] == ["succeeded"]  # type: ignore[index]


def test_flower_shows_the_published_progress_details(cluster: Cluster) -> None:
    flower, base = start_flower(cluster)
    app = cluster.app()
    cluster.worker("w1")
    result = app.progress_until_told.delay()

    def details() -> dict:  # type: ignore[type-arg]
        response = httpx.get(f"{base}/api/task/info/{result.id}", timeout=5)
        return (response.json().get("details") or {}) if response.status_code == 200 else {}

    shown = wait_until(lambda: details().get("polls", 0) >= 2, 20, "Flower to show the details of a later tick")
    assert shown
    assert details()["note"] == "é"
    page = httpx.get(f"{base}/task/{result.id}", timeout=5).text
    assert re.search(r"Details</dt>\s*<dd>\s*\{&quot;note&quot;: &quot;é&quot;, &quot;polls&quot;: \d+\}", page), page
    cluster.wake(result.id)
    assert result.get(timeout=15).startswith("told ")
    assert "Traceback" not in flower.log()


def test_flower_task_page_screenshot_after_a_takeover(cluster: Cluster, tmp_path: Path) -> None:
    """A headless-Chromium picture of a task page after a takeover (the one in the docs)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium here (.ci/run installs Debian's chromium)")
    _, base = start_flower(cluster)
    task_id, runs = zombie_scenario(cluster)
    page = f"{base}/task/{task_id}"
    shows_token = re.compile(rf"Token</dt>\s*<dd>\s*{runs[1]['token']}\s*</dd>")

    def the_whole_story() -> bool:
        text = httpx.get(page, timeout=5).text
        return bool(shows_token.search(text)) and "write-refused" in text and "succeeded" in text

    wait_until(the_whole_story, 20, "the task page to show the new token and both attempts")
    # The story comes first: the lease rows and the attempts above Flower's own table.
    html = httpx.get(page, timeout=5).text
    flowers_table = html.index("task-details-card")
    assert html.index("fenced-lease-card") < html.index("fenced-attempts") < flowers_table, html
    assert shows_token.search(html[:flowers_table]) and not shows_token.search(html[flowers_table:]), html
    assert html.index(">Status</dt>") > flowers_table  # Flower's own rows stay in its table
    picture = tmp_path / "flower-task.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1280,2000",
            f"--screenshot={picture}",
            page,
        ],
        check=True,
        capture_output=True,
        timeout=90,
    )
    data = picture.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    target = os.environ.get("FENCED_SCREENSHOT_TO")
    if target:
        shutil.copy(picture, target)


def test_flower_shows_a_task_past_its_max_duration_as_failed(cluster: Cluster) -> None:
    """The worker sends nothing for an attempt it stopped (its end is an Ignore): the FAILURE
    stored at fenced_max_task_duration must reach Flower as its own task-failed event."""
    _, base = start_flower(cluster)
    app = cluster.app()
    cluster.worker("w1")
    result = app.endless.delay()
    with pytest.raises(Exception, match="fenced_max_task_duration"):
        result.get(timeout=15)
    wait_until(lambda: cluster.record.llen(f"lost:{result.id}"), 10, "the body to be told")

    def state() -> str:
        response = httpx.get(f"{base}/api/task/info/{result.id}", timeout=5)
        return str(response.json().get("state")) if response.status_code == 200 else ""

    wait_until(lambda: state() == "FAILURE", 15, "Flower to show the task as FAILURE")
    task = httpx.get(f"{base}/api/task/info/{result.id}", timeout=5).json()
    assert "fenced_max_task_duration" in str(task.get("exception"))
    assert task["token"] == int(lease(cluster, result.id)["ownerToken"])
