"""ProgressLeasedTask, the heartbeat and the fenced backend on real worker processes.

Times are short: lease TTL 3 s, heartbeat 0.5 s, default stage deadline 2 s (see the app).
Every test asserts on what was stored: the result, its fence token, the lease and the
number of body executions.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from celery import chain

from tests.integration.conftest import KEYS, Cluster, lease, stored
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration


def only_token(cluster: Cluster) -> int:
    """The one token handed out so far: the counter's value (it starts from the server's clock)."""
    return int(cluster.results.get(KEYS.token))  # type: ignore[arg-type]


def test_a_progressing_task_keeps_its_lease_past_many_ttls(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.steady.delay(20, 0.5)  # 10 s of steady progress, TTL 3 s
    assert result.get(timeout=30) == f"done by {only_token(cluster)}"
    runs = cluster.runs(result.id)
    assert len(runs) == 1
    meta = stored(cluster, result.id)
    assert meta is not None and meta["status"] == "SUCCESS" and meta["fence_token"] == only_token(cluster)
    state = lease(cluster, result.id)
    assert state["status"] == "DONE" and state["attempt"] == "1" and state["takeovers"] == "0"
    # The finished lease lives on in the result only: no hash, no recorded call, no progress.
    assert not cluster.results.exists(KEYS.lease(result.id))
    assert meta["fence_run"] == f"{state['publishId']}/1/0" and len(state["publishId"]) == 16
    assert cluster.results.pttl(KEYS.result(result.id)) > 0  # and it expires with the result


def test_a_finished_lease_costs_redis_only_its_result(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    results = [app.steady.delay(2, 0.01) for _ in range(20)]
    assert all(r.get(timeout=30).startswith("done by ") for r in results)
    ids = {r.id for r in results}
    keys = {k.decode() for k in cluster.results.scan_iter(count=1000)}
    assert not {KEYS.lease(task_id) for task_id in ids} & keys
    assert {KEYS.result(task_id) for task_id in ids} <= keys
    indexed = {k.decode() for k in cluster.results.zrange(KEYS.index, 0, -1)}
    assert not {KEYS.lease(task_id) for task_id in ids} & indexed
    # What the package reads of them: status, final token, attempt and takeovers.
    for result in results:
        assert lease(cluster, result.id)["status"] == "DONE"
        assert int(lease(cluster, result.id)["ownerToken"]) == stored(cluster, result.id)["fence_token"]  # type: ignore[index]


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_zombie_loses_its_lease_and_its_late_result_is_refused(cluster: Cluster, pool: str) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", pool=pool, concurrency=2)
    result = app.zombie_once.delay("z")
    runs = cluster.wait_runs(result.id, 2, timeout=20)  # stalled after load-data, taken over
    assert result.get(timeout=20) == f"owner {runs[1]['token']} z"
    assert runs[1]["token"] > runs[0]["token"]
    log = worker.log()
    assert "lease stalled" in log and result.id in log
    cluster.wake(result.id)  # the zombie wakes up and returns
    wait_until(lambda: "stale write dropped" in worker.log(), 15, "the stale write to be dropped")
    meta = stored(cluster, result.id)
    assert meta is not None and meta["result"] == f"owner {runs[1]['token']} z"
    assert meta["fence_token"] == runs[1]["token"]
    lost = cluster.record.lrange(f"lost:{result.id}", 0, -1)
    assert len(lost) == 1 and "stalled" in lost[0]  # its progress() raised LeaseLostError
    assert len(cluster.runs(result.id)) == 2


def test_a_long_but_healthy_stage_is_not_taken_over(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.slow_stage.delay(8)  # stage deadline 30 s, quiet for 8 s, TTL 3 s
    assert result.get(timeout=30) == "slow ok"
    assert len(cluster.runs(result.id)) == 1
    assert lease(cluster, result.id)["takeovers"] == "0"


def test_the_same_task_id_delivered_twice_at_once_runs_once(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2)
    task_id = str(uuid.uuid4())
    app.steady.apply_async((4, 0.5), task_id=task_id)
    app.steady.apply_async((4, 0.5), task_id=task_id)
    assert app.steady.AsyncResult(task_id).get(timeout=30) == f"done by {only_token(cluster)}"
    wait_until(lambda: "duplicate delivery" in worker.log(), 15, "the duplicate to be skipped")
    assert len(cluster.runs(task_id)) == 1
    assert stored(cluster, task_id)["fence_token"] == only_token(cluster)  # type: ignore[index]


def test_a_killed_prefork_child_is_taken_over_at_once(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    result = app.killed_once.delay()
    [first] = cluster.wait_runs(result.id, 1)
    killed_at = time.monotonic()
    os.kill(first["pid"], signal.SIGKILL)
    runs = cluster.wait_runs(result.id, 2, timeout=10)
    assert result.get(timeout=10) == f"finished by {runs[1]['pid']}"
    took = time.monotonic() - killed_at
    assert took < 2.5, f"takeover after SIGKILL took {took:.2f}s (the TTL is 3s: it must not wait for it)"
    meta = stored(cluster, result.id)
    assert meta is not None and meta["status"] == "SUCCESS" and meta["fence_token"] == runs[1]["token"]
    assert lease(cluster, result.id)["status"] == "DONE"


def test_a_prefork_child_killed_before_it_takes_the_lease_is_sent_again(cluster: Cluster) -> None:
    """Killed between accepting the task and taking its lease, the process left no lease to
    lapse: the task is still sent again, and Celery's WorkerLostError is never its result."""
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=1, environ={"FENCED_TEST_HOLD_BEFORE_LEASE": "1"})
    result = app.fenced_add.delay(2, 3)
    pid = wait_until(lambda: cluster.record.get(f"before-lease:{result.id}"), 15, "the process to accept the task")
    assert lease(cluster, result.id) == {}  # accepted at once: never reserved, no lease taken
    os.kill(int(pid), signal.SIGKILL)
    cluster.record.set(f"release-before-lease:{result.id}", 1)  # for the copy sent again
    assert result.get(timeout=15) == 5
    assert "lost before it took the lease" in worker.log()
    meta = stored(cluster, result.id)
    assert meta is not None and meta["status"] == "SUCCESS"
    assert meta["fence_token"] == int(lease(cluster, result.id)["ownerToken"])
    assert "re-sent (cause=unstarted" in worker.log()


def test_a_zombie_in_a_chain_neither_stores_nor_sends_the_next_step(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2)
    flow = chain(app.chain_step.si("zombie-a"), app.chain_step.si("b"))
    result = flow.delay()
    first_id = result.parent.id
    cluster.wait_runs(first_id, 2, timeout=20)  # taken over
    assert result.get(timeout=20) == "b"
    cluster.wake(first_id)
    wait_until(lambda: "stale write dropped" in worker.log(), 15, "the zombie to be stopped")
    time.sleep(0.5)  # give a wrongly sent next step the time to show up
    assert cluster.record.llen("chain:b") == 1
    assert stored(cluster, first_id)["result"] == "zombie-a"  # type: ignore[index]
    assert len(cluster.runs(first_id)) == 2


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_interrupt_on_loss_stops_the_stalled_body(cluster: Cluster, pool: str) -> None:
    app = cluster.app()
    cluster.worker("w1", pool=pool, concurrency=2, fenced_interrupt_on_loss=True)
    result = app.blocked_until_interrupted.delay()
    assert result.get(timeout=20) == "owner"
    interrupted = wait_until(
        lambda: cluster.record.lrange(f"interrupted:{result.id}", 0, -1), 10, "the zombie to be interrupted"
    )
    assert interrupted[0] == "LeaseInterrupted"  # type: ignore[index]
    assert stored(cluster, result.id)["result"] == "owner"  # type: ignore[index]


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_a_body_that_swallows_every_exception_is_still_freed(cluster: Cluster, pool: str) -> None:
    app = cluster.app()
    cluster.worker("w1", pool=pool, concurrency=2, fenced_interrupt_on_loss=True)
    result = app.swallows_errors.delay()
    assert result.get(timeout=20) == "owner"
    interrupted = wait_until(
        lambda: cluster.record.lrange(f"interrupted:{result.id}", 0, -1), 10, "the zombie to be interrupted"
    )
    assert interrupted == ["LeaseInterrupted"]
    assert cluster.record.llen(f"swallowed:{result.id}") == 0  # its `except Exception` never saw it
    assert stored(cluster, result.id)["result"] == "owner"  # type: ignore[index]


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_a_shielded_block_is_not_cut_and_the_interrupt_follows_it(cluster: Cluster, pool: str) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", pool=pool, concurrency=2, fenced_interrupt_on_loss=True)
    result = app.shielded_block.delay()
    assert result.get(timeout=20) == "owner"  # taken over while the first attempt is shielded
    wait_until(lambda: "is shielded: interrupted when the block ends" in worker.log(), 10, "the held interrupt")
    assert cluster.record.llen(f"interrupted:{result.id}") == 0
    cluster.wake(result.id)
    interrupted = wait_until(
        lambda: cluster.record.lrange(f"interrupted:{result.id}", 0, -1), 10, "the interrupt after the block"
    )
    assert cluster.record.lrange(f"shielded:{result.id}", 0, -1) == ["block finished"]
    assert interrupted == ["LeaseInterrupted"]
    assert stored(cluster, result.id)["result"] == "owner"  # type: ignore[index]


def test_alert_mode_keeps_the_owner_and_marks_the_stall(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1")
    result = app.alert_stall.delay(5)  # 5 s quiet with a 2 s deadline
    wait_until(lambda: lease(cluster, result.id).get("status") == "STALLED", 10, "the lease to show STALLED")
    assert result.get(timeout=20) == "alert ok"
    assert len(cluster.runs(result.id)) == 1
    assert "on_stall=alert" in worker.log()
    assert lease(cluster, result.id)["takeovers"] == "0"


def test_expire_mode_lets_the_ttl_run_out_then_takeover(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2)
    cluster.beat()
    result = app.expire_stall.delay()
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    assert "left to expire" in worker.log()  # the owner was told when renewals stopped
    assert result.get(timeout=20) == f"owner {runs[1]['token']}"
    state = lease(cluster, result.id)
    assert state["takeovers"] == "1"
    cluster.wake(result.id)


def test_plain_tasks_through_the_fenced_backend_work_as_with_redis(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    assert app.plain_add.delay(2, 3).get(timeout=15) == 5
    group_result = (app.plain_add.s(1, 1) | app.plain_add.s(10)).delay()
    assert group_result.get(timeout=15) == 12


def test_bad_progress_details_and_unknown_stages(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=1)
    result = app.bad_details.delay()
    published = wait_until(lambda: lease(cluster, result.id).get("details"), 10, "the good details to be published")
    assert published == '{"done":1}', "a refused call changed the published details"
    cluster.wake(result.id)
    refused = result.get(timeout=15)
    assert len(refused) == 3, refused
    assert refused[0].startswith("TypeError: progress detail 'payload' must be a JSON value, got object")
    assert refused[1] == "ValueError: progress detail 'ratio' must be a finite number to be JSON, got nan"
    assert refused[2].startswith(
        "ValueError: progress details are 5011 bytes of JSON, more than fenced_max_detail_bytes"
    )
    assert app.unknown_stage.delay().get(timeout=15) == "ok"
    wait_until(lambda: "laod-data" in worker.log(), 5, "the unknown stages to be logged")
    log = worker.log()
    assert log.count("stage 'not-in-the-table' is not in fenced_stage_timeouts;") == 1
    assert log.count("stage 'laod-data' is not in fenced_stage_timeouts (did you mean 'load-data'?)") == 1
    assert app.unknown_stage.delay().get(timeout=15) == "ok"  # once per stage and process
    assert worker.log().count("stage 'laod-data' is not") == 1


def test_progress_outside_a_running_task_is_a_clear_error(cluster: Cluster) -> None:
    app = cluster.app()
    with pytest.raises(RuntimeError, match="outside a running task"):
        app.steady.progress("load-data")


def test_eager_calls_run_without_a_lease(cluster: Cluster) -> None:
    app = cluster.app()
    result = app.steady.apply((2, 0.01))
    assert result.get() == "done by 0"
    assert cluster.results.keys("fenced:lease:*") == []


def test_the_started_write_already_carries_the_token(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.progress_until_told.delay()
    wait_until(lambda: (stored(cluster, result.id) or {}).get("status") == "STARTED", 10, "STARTED")
    assert stored(cluster, result.id)["fence_token"] == only_token(cluster)  # type: ignore[index]
    cluster.wake(result.id)
    assert result.get(timeout=10) == f"told {only_token(cluster)}"


def test_a_failure_is_stored_with_the_token_and_ends_the_lease(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.failing.delay()
    with pytest.raises(ValueError, match="boom"):
        result.get(timeout=10)
    assert stored(cluster, result.id)["fence_token"] == only_token(cluster)  # type: ignore[index]
    assert lease(cluster, result.id)["status"] == "DONE"
    assert len(cluster.runs(result.id)) == 1


def test_a_retry_keeps_the_task_id_and_the_retried_run_acquires_anew(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.retry_once.delay()
    runs = cluster.wait_runs(result.id, 2)
    assert result.get(timeout=15) == f"retried 1 token {runs[1]['token']}"
    assert runs[1]["token"] > runs[0]["token"]
    state = lease(cluster, result.id)
    assert state["status"] == "DONE" and state["attempt"] == "2" and state["takeovers"] == "0"


def test_a_retry_lease_waits_for_the_retry_countdown_before_the_reaper_may_send_it(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.retry_in.delay(60)
    wait_until(lambda: lease(cluster, result.id).get("status") == "RETRYING", 10, "the lease to be RETRYING")
    seconds, micros = cluster.results.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    # Due after the countdown (plus the requeue timeout), not at once: the reaper must not
    # re-send a task whose retry message is merely waiting for its eta.
    assert int(lease(cluster, result.id)["leaseExpireAt"]) - now_ms > 55_000
    assert len(cluster.runs(result.id)) == 1


def test_ignore_and_ignored_results_end_the_lease_without_a_result(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    ignored = app.ignoring.delay()
    quiet = app.result_ignored.delay()
    for task_id in (ignored.id, quiet.id):
        wait_until(lambda task_id=task_id: lease(cluster, task_id).get("status") == "DONE", 10, "DONE")
        assert (stored(cluster, task_id) or {}).get("status") in (None, "STARTED")  # no READY result
        assert len(cluster.runs(task_id)) == 1


def test_max_task_duration_is_terminal(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1")
    result = app.endless.delay()
    with pytest.raises(Exception, match="fenced_max_task_duration"):
        result.get(timeout=15)
    wait_until(lambda: cluster.record.llen(f"lost:{result.id}"), 10, "the body to be told")
    assert lease(cluster, result.id)["status"] == "DONE"
    assert len(cluster.runs(result.id)) == 1


def test_groups_and_chords_of_fenced_tasks(cluster: Cluster) -> None:
    from celery import chord, group

    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    assert group(app.fenced_add.s(i, i) for i in range(5)).delay().get(timeout=20) == [0, 2, 4, 6, 8]
    assert chord((app.fenced_add.s(i, 1) for i in range(4)), app.fenced_sum.s()).delay().get(timeout=20) == 10


def test_a_redis_outage_shorter_than_the_ttl_does_not_lose_the_lease(own_cluster: Cluster) -> None:
    cluster = own_cluster
    app = cluster.app()
    worker = cluster.worker("w1")
    result = app.steady.delay(16, 0.5)  # 8 s of progress
    cluster.wait_runs(result.id, 1)
    wait_until(lambda: int(lease(cluster, result.id).get("progressVersion", 0)) >= 2, 10, "renewals")
    outage_started = time.monotonic()
    cluster.server.restart()  # stop and start on the same port, AOF on
    outage = time.monotonic() - outage_started
    assert outage < 2.5, f"the restart took {outage:.1f}s: not shorter than the 3s TTL"
    assert result.get(timeout=30) == f"done by {only_token(cluster)}"
    assert len(cluster.runs(result.id)) == 1
    state = lease(cluster, result.id)
    assert state["status"] == "DONE" and state["takeovers"] == "0"
    assert "lease lost" not in worker.log()
