"""Takeover end to end under real faults: several workers, beat running the reaper.

Each test asserts on what was stored: the task finished, its one result was written by the
lease's current token, and the body ran exactly as often as it had to.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
import uuid
from typing import Any

import pytest

from celery_fenced._operator.control import cancel, redrive
from celery_fenced._reaper.reaper import reap
from tests.integration.conftest import KEYS, Cluster, lease, rabbitmq_url, stored
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration


def assert_finished_once_by_current_owner(cluster: Cluster, task_id: str) -> dict:  # type: ignore[type-arg]
    meta = stored(cluster, task_id)
    assert meta is not None and meta["status"] == "SUCCESS", meta
    state = lease(cluster, task_id)
    assert state["status"] == "DONE"
    assert meta["fence_token"] == int(state["ownerToken"])
    return meta


def worker_running(cluster: Cluster, task_id: str, workers: list) -> object:  # type: ignore[type-arg]
    [first] = cluster.wait_runs(task_id, 1)[:1]
    return next(w for w in workers if first["hostname"].startswith(f"{w.name}@"))


def test_zombie_is_taken_over_by_another_worker(cluster: Cluster) -> None:
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    result = app.zombie_once.delay("x")
    cluster.wait_runs(result.id, 1)
    w2 = cluster.worker("w2", concurrency=1)
    cluster.beat()
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    assert runs[0]["hostname"].startswith("w1@") and runs[1]["hostname"].startswith("w2@")
    assert result.get(timeout=20) == f"owner {runs[1]['token']} x"
    cluster.wake(result.id)
    wait_until(lambda: "stale write dropped" in w1.log(), 15, "the zombie's write to be refused")
    meta = assert_finished_once_by_current_owner(cluster, result.id)
    assert meta["result"] == f"owner {runs[1]['token']} x"
    assert "parent_id" not in meta, "the re-sent call must keep its own parent, not the reaper"
    assert "lease acquired" in w2.log()


def test_sigstop_of_a_whole_worker_then_sigcont(cluster: Cluster) -> None:
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    result = app.progress_steps.delay(30, 0.2)  # 6 s of steady progress
    cluster.wait_runs(result.id, 1)
    w2 = cluster.worker("w2", concurrency=1)
    cluster.beat()
    w1.signal_group(signal.SIGSTOP)  # heartbeat and body frozen together
    try:
        runs = cluster.wait_runs(result.id, 2, timeout=25)  # after the TTL, by the reaper
        assert runs[1]["hostname"].startswith("w2@")
        assert result.get(timeout=20) == f"steps by {runs[1]['token']}"
    finally:
        w1.signal_group(signal.SIGCONT)
    lost = wait_until(lambda: cluster.record.lrange(f"lost:{result.id}", 0, -1), 15, "the zombie's progress() to raise")
    assert "expired" in lost[0] or "taken over" in lost[0]  # type: ignore[index]
    meta = assert_finished_once_by_current_owner(cluster, result.id)
    assert meta["fence_token"] == runs[1]["token"]
    assert lease(cluster, result.id)["takeovers"] == "1"
    assert "lease acquired" in w2.log()


def test_sigkill_of_a_whole_worker(cluster: Cluster) -> None:
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    result = app.progress_steps.delay(30, 0.2)
    cluster.wait_runs(result.id, 1)
    cluster.worker("w2", concurrency=1)
    cluster.beat()
    w1.signal_group(signal.SIGKILL)
    runs = cluster.wait_runs(result.id, 2, timeout=25)
    assert runs[1]["hostname"].startswith("w2@")
    assert result.get(timeout=20) == f"steps by {runs[1]['token']}"
    assert_finished_once_by_current_owner(cluster, result.id)


def test_redis_restarted_while_tasks_run(own_cluster: Cluster) -> None:
    cluster = own_cluster
    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    cluster.worker("w2", concurrency=2)
    cluster.beat()
    results = [app.progress_steps.delay(15, 0.2) for _ in range(8)]  # 3 s each
    wait_until(lambda: sum(len(cluster.runs(r.id)) > 0 for r in results) >= 2, 20, "tasks to start")
    cluster.server.stop()
    time.sleep(4)  # an outage longer than the 3 s TTL: the fault under test, not a synchronisation
    cluster.server.start()
    for result in results:
        wait_until(lambda r=result: (stored(cluster, r.id) or {}).get("status") == "SUCCESS", 60, f"task {result.id}")
    for result in results:
        meta = assert_finished_once_by_current_owner(cluster, result.id)
        assert meta["result"] == f"steps by {meta['fence_token']}"


@pytest.mark.rabbitmq
def test_zombie_takeover_with_rabbitmq_as_the_broker(cluster: Cluster) -> None:
    if rabbitmq_url() is None:
        pytest.skip(
            "needs FENCED_TEST_BROKER=rabbitmq (the broker-rabbitmq tox env) and a RabbitMQ reachable on 127.0.0.1:5672"
        )
    assert cluster.broker_url.startswith("amqp://")
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    result = app.zombie_once.delay("mq")
    cluster.wait_runs(result.id, 1)
    cluster.worker("w2", concurrency=1)
    cluster.beat()
    runs = cluster.wait_runs(result.id, 2, timeout=25)
    assert result.get(timeout=20) == f"owner {runs[1]['token']} mq"
    cluster.wake(result.id)
    wait_until(lambda: "stale write dropped" in w1.log(), 15, "the zombie's write to be refused")
    assert_finished_once_by_current_owner(cluster, result.id)


def test_a_stuck_single_process_worker_does_not_hoard_the_resent_message(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=1)
    result = app.zombie_once.delay("hoard")
    cluster.wait_runs(result.id, 1)
    cluster.worker("w2", concurrency=1)
    cluster.beat()
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    assert runs[1]["hostname"].startswith("w2@"), "the re-sent message waited behind the stuck process"
    assert result.get(timeout=10).startswith("owner ")
    cluster.wake(result.id)


def test_takeovers_past_the_maximum_abandon_the_task(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=2, fenced_max_takeovers=0)
    task_id = str(uuid.uuid4())
    result = app.zombie_once.apply_async(("ab",), task_id=task_id)
    from celery_fenced.exceptions import TaskAbandonedError

    with pytest.raises(TaskAbandonedError):
        result.get(timeout=20)
    state = lease(cluster, task_id)
    assert state["status"] == "ABANDONED"
    assert stored(cluster, task_id)["fence_token"] == int(state["ownerToken"])  # type: ignore[index]
    cluster.wake(task_id)


def test_alert_task_is_not_reenqueued_for_a_stall_but_is_when_its_owner_is_gone(cluster: Cluster) -> None:
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    result = app.alert_stall.delay(30)  # stalls (alert) for 30 s
    cluster.wait_runs(result.id, 1)
    cluster.worker("w2", concurrency=1)
    cluster.beat(loglevel="DEBUG")  # its "Sending due task celery_fenced.reap" lines are DEBUG
    wait_until(lambda: lease(cluster, result.id).get("status") == "STALLED", 10, "STALLED")
    beat = next(p for p in cluster.processes if p.name == "beat")
    sent = beat.log().count("Sending due task celery_fenced.reap")
    wait_until(lambda: beat.log().count("Sending due task celery_fenced.reap") >= sent + 2, 10, "two reaper runs")
    assert len(cluster.runs(result.id)) == 1  # a stalled alert task is never re-enqueued
    w1.signal_group(signal.SIGKILL)  # now the owner is gone
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    assert runs[1]["hostname"].startswith("w2@")


def test_cancel_ends_a_running_task_for_good(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=1)
    result = app.progress_steps.delay(50, 0.2)
    cluster.wait_runs(result.id, 1)
    assert cancel(app.app, result.id) == "cancelled"
    lost = wait_until(lambda: cluster.record.lrange(f"lost:{result.id}", 0, -1), 10, "the owner to be told")
    assert "cancelled (celery fenced cancel)" in lost[0]  # type: ignore[index]
    meta = stored(cluster, result.id)
    assert meta is not None and meta["status"] == "REVOKED"
    assert lease(cluster, result.id)["status"] == "DONE"
    assert "lease lost" in worker.log()
    assert cancel(app.app, result.id) == "finished"


def test_redrive_puts_an_abandoned_task_back(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=2, fenced_max_takeovers=0)
    result = app.zombie_once.delay("rd")
    wait_until(lambda: lease(cluster, result.id).get("status") == "ABANDONED", 20, "ABANDONED")
    cluster.wake(result.id)
    cluster.results.hset(KEYS.lease(result.id), "maxTakeovers", 3)  # the operator raised the limit
    assert redrive(app.app, result.id) == "redriven"
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    # The abandon's FAILURE was published to this client's subscription before the redrive:
    # Celery's get() reads the stored result first, then the messages in the order they came,
    # so it returns the new owner's result once that is stored (a client that asks while the
    # redriven run is still running is answered by the abandon's message, as Celery answers
    # any READY message).
    wait_until(lambda: (stored(cluster, result.id) or {}).get("status") == "SUCCESS", 20, "the new owner's result")
    assert result.get(timeout=20) == f"owner {runs[1]['token']} rd"
    assert_finished_once_by_current_owner(cluster, result.id)


def redelivered(app: Any, cluster: Cluster) -> bool:
    """Whether a worker refused the redelivered copy; puts unacked messages past their
    visibility timeout back first.

    kombu 5.7 does that every ``unacked_restore_interval``; kombu 5.5 and 5.6 only every
    100 s, longer than the test waits, so the test asks kombu's own restore to run now.
    """
    with app.connection_for_write() as connection:
        connection.default_channel.qos.restore_visible(num=100, interval=1)
    return "not run: done delivery" in "".join(p.log() for p in cluster.processes)


def test_an_acks_late_redelivery_after_a_takeover_does_not_run_a_third_time(cluster: Cluster) -> None:
    cluster.settings = {
        "task_acks_late": True,
        "broker_transport_options": {
            "visibility_timeout": 6,
            "unacked_restore_interval": 1,  # sweep for unacked messages every second
            "unacked_restore_throttle": 1,
        },
    }
    app = cluster.app()
    cluster.worker("w1", concurrency=1)
    result = app.zombie_once.delay("late")
    cluster.wait_runs(result.id, 1)
    cluster.worker("w2", concurrency=1)
    cluster.beat()
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    assert result.get(timeout=20) == f"owner {runs[1]['token']} late"
    # The zombie never acked: its message comes back after the visibility timeout.
    wait_until(lambda: redelivered(app.app, cluster), 30, "the redelivery")
    assert len(cluster.runs(result.id)) == 2
    cluster.wake(result.id)
    assert runs[0]["hostname"].startswith("w1@") and runs[1]["hostname"].startswith("w2@")


def test_reap_is_safe_when_run_twice_at_once_and_takes_the_time(cluster: Cluster) -> None:
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=2)
    result = app.progress_until_told.delay()
    first_run = cluster.wait_runs(result.id, 1)[0]
    # Frozen, the worker neither renews nor reaps: the two reaps below are the only ones.
    w1.signal_group(signal.SIGSTOP)
    try:
        expire_at = int(lease(cluster, result.id)["leaseExpireAt"])
        wait_until(lambda: time.time() * 1000 > expire_at + 200, 10, "the lease to expire")
        start = threading.Barrier(2)
        claims: list[int] = []

        def reap_at_once() -> None:
            start.wait(timeout=10)
            try:
                claims.append(reap(app.app).claimed)
            finally:
                backend = app.app.backend  # Celery keeps a backend per thread: close this one's
                backend.lease_store.close()
                backend.client.close()

        reapers = [threading.Thread(target=reap_at_once) for _ in range(2)]
        for reaper in reapers:
            reaper.start()
        for reaper in reapers:
            reaper.join(timeout=30)
        assert sorted(claims) == [0, 1]
    finally:
        w1.signal_group(signal.SIGCONT)
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    assert len(runs) == 2 and runs[1]["token"] > first_run["token"]
    cluster.wake(result.id)
    assert result.get(timeout=20) == f"told {runs[1]['token']}"
    assert reap(app.app, now=time.time() + 3600).claimed == 0  # the claim re-validates on the server
    assert int(lease(cluster, result.id)["takeovers"]) == 1


def test_chaos_soak(cluster: Cluster) -> None:
    """100+ tasks over 3 workers, random stalls, SIGKILLs and SIGSTOP/SIGCONT, ≤ 3 minutes."""
    rng = random.Random(20261202)
    app = cluster.app()
    workers = [cluster.worker(f"w{i}", concurrency=2) for i in range(1, 4)]
    cluster.beat()
    results = [app.soak.delay(i, rng.random() < 0.15) for i in range(120)]
    ids = [r.id for r in results]
    deadline = time.monotonic() + 150
    kills = stops = 0
    while time.monotonic() < deadline:
        done = sum(1 for task_id in ids if (stored(cluster, task_id) or {}).get("status") == "SUCCESS")
        if done == len(ids):
            break
        victim = rng.choice(workers)
        action = rng.random()
        if action < 0.35 and victim.children():
            child = rng.choice(victim.children())
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
                kills += 1
        elif action < 0.6:
            victim.signal_group(signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 4.5))  # the fault: a pause, sometimes longer than the TTL
            victim.signal_group(signal.SIGCONT)
            stops += 1
        time.sleep(rng.uniform(0.5, 1.5))  # pacing of the faults, not a synchronisation
    cluster.record.set("soak:wake", 1)  # wake every zombie: their writes must all be refused
    for index, result in enumerate(results):
        assert result.get(timeout=60).startswith(f"{index} by ")
    takeovers = fenced = 0
    for task_id in ids:
        meta = assert_finished_once_by_current_owner(cluster, task_id)
        assert meta["result"].endswith(f"by {meta['fence_token']}")
        takeovers += int(lease(cluster, task_id)["takeovers"])
    logs = "".join(w.log() for w in workers)
    fenced = logs.count("stale write dropped")
    print(
        f"soak: {len(ids)} tasks, {kills} child kills, {stops} SIGSTOPs, {takeovers} takeovers, {fenced} stale writes refused"
    )
    assert takeovers > 0
