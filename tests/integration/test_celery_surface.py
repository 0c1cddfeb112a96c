"""Celery's own features on fenced tasks end as Celery would, on real workers.

Each test is a defect found on the feature surface: without its fix the client waits
forever (the test times out), a task is lost, or a stale write lands.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import redis
from celery import chain, chord

from tests.integration.conftest import KEYS, Cluster, lease, stored
from tests.support.processes import ROOT, CeleryProcess, wait_until

pytestmark = pytest.mark.integration


# -- replace() --------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "expected"), [("fenced", 5), ("plain", 23), ("chain", 5), ("group", [2, 4])])
def test_replace_passes_the_task_id_to_its_replacement(cluster: Cluster, kind: str, expected: object) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.replaced_by.delay(kind)
    assert result.get(timeout=20) == expected
    meta = stored(cluster, result.id)
    assert meta is not None and meta["status"] == "SUCCESS"
    first = cluster.runs(result.id)[0]
    if kind == "fenced":
        # The replacement took a lease of its own, with a higher token than the replaced task's.
        assert meta["fence_token"] > first["token"]
        assert lease(cluster, result.id)["status"] == "DONE"


# -- failures along a chain, Reject, the body's own stale writes -----------------------------------


@pytest.mark.parametrize("first", ["failing", "plain_failing"])
def test_a_failing_chain_step_fails_every_later_step(cluster: Cluster, first: str) -> None:
    app = cluster.app()
    cluster.worker("w1")
    steps = chain(getattr(app, first).si(), app.fenced_add.si(1, 2), app.plain_add.si(3, 4))
    result = steps.apply_async()
    with pytest.raises(ValueError, match="boom"):
        result.get(timeout=20)  # the last step's FAILURE: without it, get() waits forever
    # Celery stores the later steps' FAILUREs from the last one back: the middle one comes just after.
    wait_until(lambda: result.parent.state == "FAILURE", 10, "the middle step's FAILURE")


def test_reject_without_requeue_stores_a_failure(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.rejecting.delay(False)
    with pytest.raises(Exception, match="not for me"):
        result.get(timeout=20)
    meta = stored(cluster, result.id)
    assert meta is not None and meta["status"] == "FAILURE"
    assert meta["fence_token"] == cluster.runs(result.id)[0]["token"]
    assert lease(cluster, result.id)["status"] == "DONE"


def test_reject_with_requeue_runs_again(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.rejecting.delay(True)
    assert result.get(timeout=20) is None
    assert len(cluster.runs(result.id)) == 2


def test_a_stale_owner_error_of_the_body_is_stored_as_its_failure(cluster: Cluster) -> None:
    from celery_fenced import StaleOwnerError
    from celery_fenced.fencing import fenced_set

    app = cluster.app()
    cluster.worker("w1")
    fenced_set(cluster.record, "row:1", "by a newer task", 2**62)  # above any token the clock gives
    result = app.write_row.delay("row:1")
    with pytest.raises(StaleOwnerError):
        result.get(timeout=20)
    assert stored(cluster, result.id)["status"] == "FAILURE"  # type: ignore[index]
    assert lease(cluster, result.id)["status"] == "DONE"


# -- an abandoned task still runs Celery's side effects ----------------------------------------------


def test_an_abandoned_chain_step_fails_the_rest_and_calls_its_errback(cluster: Cluster) -> None:
    from celery_fenced import TaskAbandonedError

    app = cluster.app()
    cluster.worker("w1", concurrency=4)  # both attempts stay stuck: the reaper needs a free process
    cluster.beat()
    stuck = app.always_stalls.si().on_error(app.record_errback.s())
    result = chain(stuck, app.fenced_add.si(1, 2)).apply_async()
    with pytest.raises(TaskAbandonedError):
        result.get(timeout=60)
    wait_until(lambda: cluster.record.llen(f"errback:{result.parent.id}"), 20, "the errback")
    assert cluster.record.lrange(f"errback:{result.parent.id}", 0, -1) == ["TaskAbandonedError"]
    for task_id in (result.id, result.parent.id):
        cluster.wake(task_id)


def test_an_abandoned_chord_member_fires_the_chord_body_with_its_error(cluster: Cluster) -> None:
    from celery.exceptions import ChordError

    app = cluster.app()
    cluster.worker("w1", concurrency=4)
    cluster.beat()
    stuck = app.always_stalls.si()
    result = chord([app.fenced_add.s(1, 1), stuck], app.fenced_sum.s()).apply_async()
    wait_until(lambda: (stored(cluster, result.id) or {}).get("status") == "FAILURE", 60, "the chord body's FAILURE")
    error = stored(cluster, result.id)["result"]  # type: ignore[index]
    assert error["exc_type"] == ChordError.__name__ and "TaskAbandonedError" in error["exc_message"][0]
    for child in result.parent.results:
        cluster.wake(child.id)


# -- tokenless writes of the worker's main process -------------------------------------------------


def test_a_stalled_attempts_time_limit_leaves_the_new_owner_on_the_same_host_alone(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2)
    cluster.beat()
    result = app.stalls_into_time_limit.delay()
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    wait_until(lambda: "Hard time limit" in worker.log(), 20, "the first attempt's hard time limit")
    assert result.get(timeout=30) == f"owner {runs[1]['token']}"
    meta = stored(cluster, result.id)
    assert meta is not None and meta["status"] == "SUCCESS" and meta["fence_token"] == runs[1]["token"]


def test_an_expired_duplicates_revoke_does_not_end_the_live_owner(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2)
    task_id = str(uuid.uuid4())
    app.progress_until_told.apply_async(task_id=task_id)
    cluster.wait_runs(task_id, 1)
    past = datetime.now(timezone.utc) - timedelta(seconds=5)
    app.progress_until_told.apply_async(task_id=task_id, expires=past)  # a copy, expired on arrival
    discarded = f"Discarding revoked task: tests.integration.apps.fenced_app.progress_until_told[{task_id}]"
    wait_until(lambda: discarded in worker.log(), 20, "the expired copy to be discarded")
    assert lease(cluster, task_id)["status"] == "RUNNING"
    cluster.wake(task_id)
    [run] = cluster.runs(task_id)
    assert app.progress_until_told.AsyncResult(task_id).get(timeout=20) == f"told {run['token']}"


# -- the heartbeat and retries ---------------------------------------------------------------------


def test_a_short_lease_that_starts_on_an_idle_process_is_renewed(cluster: Cluster) -> None:
    app = cluster.app()
    # The app's interval is long; the task's own is short: the heartbeat thread sits in a
    # long wait when the short lease arrives.
    cluster.worker("w1", pool="solo", concurrency=1, fenced_lease_ttl=40, fenced_heartbeat_interval=15)
    assert app.fenced_add.delay(1, 2).get(timeout=20) == 3
    result = app.short_lease.delay(20)  # 4 s of progress, TTL 1.5 s
    value = result.get(timeout=20)
    [run] = cluster.runs(result.id)
    assert value == f"short {run['token']}"
    assert lease(cluster, result.id)["takeovers"] == "0"


def test_retry_with_no_countdown_runs_the_retry_at_once(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    result = app.retry_now.delay()
    assert result.get(timeout=4) == "retried 1"  # the requeue timeout is 5 s
    assert [run["retries"] for run in cluster.runs(result.id)] == [0, 1]


# -- two apps in one module --------------------------------------------------------------------------


def test_the_plain_app_of_a_module_with_a_fenced_app_starts_and_runs(cluster: Cluster) -> None:
    cluster.app()
    from tests.integration.apps import two_apps

    argv = ["-A", "tests.integration.apps.two_apps:plain_app", "worker", "-P", "solo", "-l", "INFO"]
    argv += ["-n", f"plain@{socket.gethostname()}", "--without-mingle", "--without-gossip", "-Q", "plain"]
    proc = CeleryProcess("plain", argv, cluster.env(), cluster.tmp_path / "plain.log", " ready.")
    cluster.processes.append(proc)
    proc.wait_ready()
    from celery_fenced.exceptions import ConfigurationError

    plain = two_apps.plain_app
    plain.conf.update(broker_url=cluster.broker_url, result_backend=cluster.server.url(1))
    try:
        assert two_apps.doubled.apply_async((21,), queue="plain").get(timeout=20) == 42
        assert "shared into app 'plain_side'" in proc.log()
        # A fenced task sent to the plain app's worker fails at once, naming what is wrong.
        copy = plain.send_task("tests.integration.apps.two_apps.leased", (1,), queue="plain")
        with pytest.raises(ConfigurationError, match="needs the fenced result backend"):
            copy.get(timeout=20)
    finally:  # this app's connections are this test's: close them, not the garbage collector
        plain.backend.result_consumer.stop()
        plain.backend.client.close()
        plain.close()


# -- a lease hash that vanishes (eviction, FLUSH, a failover that lost writes) ---------------------


def test_a_vanished_lease_is_restored_by_its_owner_who_finishes(cluster: Cluster) -> None:
    from tests.integration.conftest import KEYS

    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    result = app.progress_until_told.delay()
    cluster.wait_runs(result.id, 1)
    cluster.results.delete(KEYS.lease(result.id))
    wait_until(lambda: "restoredAt" in lease(cluster, result.id), 10, "the owner to restore its lease")
    cluster.wake(result.id)
    value = result.get(timeout=20)
    [run] = cluster.runs(result.id)
    assert value == f"told {run['token']}"
    assert lease(cluster, result.id)["status"] == "DONE"


def test_a_vanished_lease_whose_owner_then_dies_is_still_taken_over(cluster: Cluster) -> None:
    import os
    import signal

    from tests.integration.conftest import KEYS

    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    cluster.beat()
    result = app.killed_once.delay()
    [first] = cluster.wait_runs(result.id, 1)
    cluster.results.delete(KEYS.lease(result.id))
    wait_until(lambda: "restoredAt" in lease(cluster, result.id), 10, "the owner to restore its lease")
    os.kill(first["pid"], signal.SIGKILL)
    runs = cluster.wait_runs(result.id, 2, timeout=20)  # re-sent from the restored call
    assert result.get(timeout=20) == f"finished by {runs[1]['pid']}"
    assert runs[1]["token"] > first["token"]


def test_update_state_of_another_task_leaves_the_callers_lease_alone(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    other = app.progress_until_told.delay()
    [other_run] = cluster.wait_runs(other.id, 1)
    result = app.updates_another.delay(other.id)
    assert result.get(timeout=20) == f"mine {cluster.runs(result.id)[0]['token']}"
    assert lease(cluster, result.id)["status"] == "DONE"
    assert lease(cluster, other.id)["ownerToken"] == str(other_run["token"])  # the running task's own
    cluster.wake(other.id)
    assert other.get(timeout=20) == f"told {other_run['token']}"


# -- a finished task id applied again ----------------------------------------------------------------


def test_a_finished_task_id_applied_again_runs_again_as_in_celery(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2)
    task_id = str(uuid.uuid4())
    assert app.fenced_failing_once.apply_async(task_id=task_id).get(timeout=20, propagate=False)
    first = lease(cluster, task_id)
    assert stored(cluster, task_id)["status"] == "FAILURE"  # type: ignore[index]
    app.fenced_failing_once.apply_async(task_id=task_id)  # applied again: it runs again, as in Celery
    wait_until(lambda: (stored(cluster, task_id) or {}).get("status") == "SUCCESS", 20, "the second run")
    second = lease(cluster, task_id)
    assert int(second["ownerToken"]) > int(first["ownerToken"]) and second["status"] == "DONE"
    # Celery keeps a stored SUCCESS: a third apply runs, and the SUCCESS stays as it was.
    app.fenced_failing_once.apply_async(task_id=task_id)
    wait_until(lambda: len(cluster.runs(task_id)) == 3, 20, "the third run")
    wait_until(lambda: lease(cluster, task_id)["status"] == "DONE", 20, "the third run to end")
    assert stored(cluster, task_id)["fence_token"] == int(second["ownerToken"])  # type: ignore[index]
    # A copy of a finished run (the same publish: a redelivery, a late re-send) does not run.
    copy = {"fenced_publish_id": lease(cluster, task_id)["publishId"]}
    app.fenced_failing_once.apply_async(task_id=task_id, headers=copy)
    wait_until(lambda: "done delivery" in worker.log(), 20, "the copy to be refused")
    assert len(cluster.runs(task_id)) == 3


def test_a_cancelled_chord_member_fires_the_chord_body_with_its_error(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    waiting = app.progress_until_told.si()
    result = chord([app.fenced_add.s(1, 1), waiting], app.fenced_sum.s()).apply_async()
    member = result.parent.results[1].id
    cluster.wait_runs(member, 1)
    assert cluster.cli("cancel", member).returncode == 0
    wait_until(lambda: (stored(cluster, result.id) or {}).get("status") == "FAILURE", 20, "the chord body's FAILURE")
    error = stored(cluster, result.id)["result"]  # type: ignore[index]
    assert error["exc_type"] == "ChordError" and "TaskRevokedError" in error["exc_message"][0]
    cluster.wake(member)


def test_a_task_stopped_at_its_max_duration_calls_its_errback_once(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    result = app.endless.apply_async(link_error=app.record_errback.s())
    wait_until(lambda: cluster.record.llen(f"errback:{result.id}"), 20, "the errback")
    assert stored(cluster, result.id)["status"] == "FAILURE"  # type: ignore[index]
    wait_until(lambda: lease(cluster, result.id)["status"] == "DONE", 10, "the lease to end")
    assert cluster.record.lrange(f"errback:{result.id}", 0, -1) == ["TimeLimitExceeded"]
    with pytest.raises(Exception, match="fenced_max_task_duration"):
        result.get(timeout=10)


# -- a backlog is not a failure ----------------------------------------------------------------------


def test_a_task_waiting_in_a_long_queue_is_never_abandoned(cluster: Cluster) -> None:
    app = cluster.app()
    settings = {"fenced_max_takeovers": 1, "fenced_requeue_timeout": 1}
    # The task's queue has one process, held by its stalled first attempt: the re-sent
    # message waits behind it, in the queue, for several requeue timeouts. The reaper runs
    # on another worker.
    cluster.worker("slow", concurrency=1, queues="slowq", **settings)
    cluster.worker("reaper", concurrency=2, queues="celery", **settings)
    cluster.beat(**settings)
    result = app.zombie_once.apply_async(("q",), queue="slowq")
    wait_until(lambda: lease(cluster, result.id).get("status") == "REQUEUED", 20, "the takeover")
    wait_until(lambda: lease(cluster, result.id).get("resends") == "1", 20, "a re-send of the waiting message")
    resent_due = int(lease(cluster, result.id)["leaseExpireAt"])
    # One more pass finds it still waiting: sent as often as allowed, it only waits.
    wait_until(lambda: int(lease(cluster, result.id)["leaseExpireAt"]) > resent_due, 20, "a later reaper pass")
    state = lease(cluster, result.id)
    assert state["status"] == "REQUEUED" and state["takeovers"] == "1" and state["resends"] == "1"
    cluster.wake(result.id)  # the process frees: the task ends with a result, not abandoned
    assert result.get(timeout=30).endswith(" q")  # the woken first attempt's, or a queued copy's
    wait_until(lambda: lease(cluster, result.id)["status"] == "DONE", 10, "the lease to end")
    assert lease(cluster, result.id)["takeovers"] == "1"


# -- a client's exit --------------------------------------------------------------------------


def readme_program() -> str:
    """The whole program the README's *Use it* section shows (``proj.py``)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use it") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_a_client_that_waited_on_fenced_results_exits_without_a_traceback(cluster: Cluster, tmp_path: Path) -> None:
    """The README's program and client, on a real worker: get() a result, and give up waiting
    on one no worker has taken yet. Its ``AsyncResult`` is collected while Python shuts down:
    nothing is printed then (no ``Exception ignored in: AsyncResult.__del__ … sys.meta_path
    is None``: leaving the subscription then connected again, and imported)."""
    (tmp_path / "proj.py").write_text(readme_program())
    env = {
        **cluster.env(),
        "REDIS_URL": cluster.server.url(0).rsplit("/", 1)[0],
        "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}",
    }
    # A README user has no Django settings; with them, Celery's Django fix-up imports Django,
    # and the order in which Python tears modules down at exit hid the traceback.
    env.pop("DJANGO_SETTINGS_MODULE", None)
    worker = CeleryProcess(
        "proj", ["-A", "proj", "worker", "-P", "solo", "-l", "INFO"], env, tmp_path / "proj.log", " ready."
    )
    cluster.processes.append(worker)
    worker.wait_ready()
    client = (
        "from celery.exceptions import TimeoutError\n"
        "from proj import build_report\n"
        "print(build_report.delay(10).get(timeout=30)['summary'])\n"
        "waiting = build_report.apply_async((10,), queue='nobody')\n"
        "try:\n"
        "    waiting.get(timeout=1.5)\n"
        "except TimeoutError:\n"
        "    print('not taken yet')\n"
    )
    for _ in range(3):  # it showed every time: three runs rule out luck
        done = subprocess.run(
            [sys.executable, "-c", client], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert (done.returncode, done.stdout, done.stderr) == (0, "45\nnot taken yet\n", "")


# -- the rows of docs/celery-features.rst that no other test showed ---------------------------


def test_autoretry_for_with_backoff_is_a_retry_not_a_takeover(cluster: Cluster) -> None:
    """Celery's ``autoretry_for`` and ``retry_backoff`` keep their meaning: each retry waits its
    backoff, acquires the lease anew with a higher token, and counts as an attempt, never as a
    takeover."""
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=1)
    result = app.autoretried.delay()
    assert result.get(timeout=30) == "ran after 2 retries"
    runs = cluster.runs(result.id)
    assert [(run["retries"], run["attempt"]) for run in runs] == [(0, 1), (1, 2), (2, 3)]
    assert runs[0]["token"] < runs[1]["token"] < runs[2]["token"]
    gaps = [later["started"] - earlier["started"] for earlier, later in itertools.pairwise(runs)]
    assert min(gaps) >= 0.9  # each retry waited its backoff
    fields = lease(cluster, result.id)
    assert (fields["status"], fields["attempt"], fields["takeovers"]) == ("DONE", "3", "0")
    wait_until(lambda: "(retry 2 of the task, not a takeover)" in worker.log(), 10, "the retry's log line")
    assert "takeover" not in worker.log().replace("not a takeover", "")


def test_a_bound_errback_gets_the_task_id_by_celerys_rule(cluster: Cluster) -> None:
    """``link_error`` on a fenced task: Celery's rule decides the errback's arguments. A bound
    errback is sent the failed task's id only; an unbound one with ``(request, exc, traceback)``
    is called with those. Each runs once, after the owner stored the failure."""
    app = cluster.app()
    cluster.worker("w1", concurrency=1)
    bound = app.failing.apply_async(link_error=app.bound_errback_of_task_id.s())
    unbound = app.failing.apply_async(link_error=app.record_errback.s())
    wait_until(lambda: cluster.record.llen(f"bound-errback:{bound.id}") >= 1, 20, "the bound errback")
    wait_until(lambda: cluster.record.llen(f"errback:{unbound.id}") >= 1, 20, "the unbound errback")
    for result in (bound, unbound):
        assert stored(cluster, result.id)["status"] == "FAILURE"  # type: ignore[index]
    (called,) = [json.loads(x) for x in cluster.record.lrange(f"bound-errback:{bound.id}", 0, -1)]
    assert called == {"errback": app.bound_errback_of_task_id.name, "task_id": bound.id}
    assert cluster.record.lrange(f"errback:{unbound.id}", 0, -1) == ["ValueError"]


def test_result_expires_bounds_the_result_and_the_finished_lease(cluster: Cluster) -> None:
    """A finished task's fence lives in its result (or a small tombstone) and expires with it."""
    cluster.settings = {"result_expires": 30}
    app = cluster.app()
    cluster.worker("w1", concurrency=1)
    done = app.noted_add.delay(2, 3)
    assert done.get(timeout=20) == 5
    assert 0 < cluster.results.ttl(KEYS.result(done.id)) <= 30
    assert not cluster.results.exists(KEYS.lease(done.id))  # the fence is in the result
    assert lease(cluster, done.id)["status"] == "DONE"
    ignored = app.result_ignored.delay()
    wait_until(lambda: lease(cluster, ignored.id).get("status") == "DONE", 20, "the ignored result's lease DONE")
    assert not cluster.results.exists(KEYS.result(ignored.id))
    assert 0 < cluster.results.ttl(KEYS.lease(ignored.id)) <= 30  # its tombstone


def test_a_countdown_longer_than_the_visibility_timeout_runs_once(cluster: Cluster) -> None:
    """A message waiting for its eta is not acknowledged: past the broker's visibility timeout
    kombu hands it out again, and plain Celery runs the task once per copy. The lease runs it
    once: each copy finds the reservation or the running or finished lease."""
    if not cluster.broker_url.startswith("redis"):
        pytest.skip("the visibility timeout is the Redis transport's")
    cluster.settings = {
        "broker_transport_options": {
            "visibility_timeout": 2,
            "unacked_restore_interval": 1,  # kombu 5.7 sweeps every second; older kombu is asked below
            "unacked_restore_throttle": 1,
        },
    }
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    w2 = cluster.worker("w2", concurrency=1)
    result = app.noted_add.apply_async((2, 3), countdown=6)

    def copies() -> int:
        with app.app.connection_for_write() as connection:
            connection.default_channel.qos.restore_visible(num=100, interval=1)
        return (w1.log() + w2.log()).count(f"{app.noted_add.name}[{result.id}] received")

    wait_until(lambda: copies() >= 2, 20, "a second copy of the waiting message")
    assert result.get(timeout=20) == 5
    broker = redis.Redis.from_url(cluster.broker_url)
    try:
        wait_until(lambda: not broker.hlen("unacked") and not broker.llen("celery"), 30, "every copy handled")
    finally:
        broker.close()
    # A copy leaves the broker when its worker takes it (acked on receipt); its end is logged
    # once its eta came and its delivery found the task done.
    wait_until(lambda: "not run: " in w1.log() + w2.log(), 20, "the other copy to find the task done")
    assert len(cluster.runs(result.id)) == 1
