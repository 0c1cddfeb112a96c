"""A Sentinel failover that lost acknowledged writes, on real workers.

A primary, one replica and three Sentinels on loopback (:mod:`tests.support.replication`); the
worker and the clients use ``sentinel://`` for the broker and ``fenced+sentinel://`` for results.
Tasks run and replicate; then the replica is held back (its link open, nothing passed on) while
more tasks run; then the primary is killed and Sentinel promotes the replica, which never got
those tasks' writes, the token counter's increments among them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_fenced.exceptions import StaleOwnerError
from celery_fenced.fencing import fenced_set
from tests.integration.conftest import BACKEND_DB, BROKER_DB, KEYS, Cluster, lease, stored
from tests.support.processes import wait_until
from tests.support.redis_server import RedisServer, default_binary
from tests.support.replication import MASTER_NAME, ReplicatedRedis

pytestmark = pytest.mark.integration

#: The test app's lease TTL (``fenced_app``), seconds.
TTL = 3

#: A client's publish retries while Sentinel promotes the replica (Celery's default gives up
#: after 0.6 s, before Sentinel has even agreed that the primary is down).
THROUGH_A_FAILOVER = {"max_retries": 60, "interval_start": 0.1, "interval_step": 0.1, "interval_max": 0.25}


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[ReplicatedRedis]:
    group = ReplicatedRedis(default_binary(), tmp_path / "redis", down_after_ms=1000).start()
    yield group
    group.stop()


def on_sentinel(cluster: Cluster, group: ReplicatedRedis, fenced: bool = True) -> Cluster:
    """Point the cluster's workers and clients at the Sentinels (results stay readable across)."""
    cluster.broker_url = group.sentinel_url("", BROKER_DB)
    cluster.backend_url = group.sentinel_url("fenced+" if fenced else "", BACKEND_DB)
    options = {"master_name": MASTER_NAME}
    cluster.settings = {
        "broker_transport_options": options,
        "result_backend_transport_options": options,
        # A re-sent message that lands behind the zombie in a worker's buffer goes on in 5 s.
        "fenced_start_timeout": 5,
    }
    cluster.results.close()
    cluster.results = group.primary_client(BACKEND_DB)
    return cluster


@pytest.fixture
def failover_cluster(
    redis_server: RedisServer, replicated: ReplicatedRedis, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """Workers on the Sentinels; bodies record their runs (and write their rows) on the session's Redis."""
    cluster = on_sentinel(Cluster(redis_server, tmp_path), replicated)
    cluster.record.flushdb()
    yield cluster
    cluster.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(cluster.logs()[-20000:])
        print(replicated.logs())
    cluster.record.flushdb()


def tokens_of(cluster: Cluster, task_ids: list[str]) -> list[int]:
    """The token each task's result was written with."""
    metas = [stored(cluster, t) or {} for t in task_ids]
    assert all("fence_token" in m for m in metas), metas
    return [int(m["fence_token"]) for m in metas]


def all_succeed(cluster: Cluster, results: list[Any], timeout: float) -> None:
    for result in results:
        assert result.get(timeout=timeout) is not None


def test_tokens_after_a_failover_that_lost_writes_are_above_every_token_before_it(
    failover_cluster: Cluster, replicated: ReplicatedRedis
) -> None:
    cluster = failover_cluster
    app = cluster.app()
    cluster.worker("w1", concurrency=4)
    # A second worker: with late acks (Celery 5.5), a worker that reconnects takes no new
    # message while a task it started before runs on (the zombie here); another one does.
    cluster.worker("w2", concurrency=2)

    replicated_ones = [app.fenced_add.delay(n, 1) for n in range(20)]
    all_succeed(cluster, replicated_ones, 30)
    assert app.write_row.delay("row").get(timeout=30) == "written"
    replicated.wait_replicated()

    replicated.proxy.hold()  # from here on, nothing reaches the replica
    lost_ones = [app.fenced_add.delay(n, 2) for n in range(20)]
    all_succeed(cluster, lost_ones, 30)
    assert app.write_row.delay("row").get(timeout=30) == "written"
    row_fence = int(cluster.record.get("fence:{row}") or 0)
    zombie = app.zombie_once.delay("across")  # its lease is lost with the failover, its owner lives
    cluster.wait_runs(zombie.id, 1)
    in_flight = [app.steady.delay(20, 0.3) for _ in range(2)]  # 6 s each, running across the failover
    for result in in_flight:
        cluster.wait_runs(result.id, 1)
    before = tokens_of(cluster, [r.id for r in replicated_ones + lost_ones])

    replicated.kill_primary()
    killed = time.monotonic()
    first_after = app.fenced_add.apply_async((100, 1), retry_policy=THROUGH_A_FAILOVER)
    assert first_after.get(timeout=60) == 101
    recovery = time.monotonic() - killed
    replicated.wait_promoted()
    with replicated.replica.client(BACKEND_DB) as promoted:
        assert not promoted.exists(KEYS.result(lost_ones[0].id))  # the writes were lost indeed

    after_ones = [app.fenced_add.delay(n, 3) for n in range(20)]
    all_succeed(cluster, after_ones, 30)
    after = tokens_of(cluster, [first_after.id] + [r.id for r in after_ones])
    assert min(after) > max(before), (before, after)

    # The shared row: the first owner after the failover writes over the last one before it.
    assert app.write_row.delay("row").get(timeout=30) == "written"
    new_fence = int(cluster.record.get("fence:{row}") or 0)
    assert new_fence > row_fence > max(before[:20])
    with pytest.raises(StaleOwnerError):  # an attempt older than that write is refused
        fenced_set(cluster.record, "row", "late", row_fence)

    # Tasks in flight across the failover finish once, by the token of their last run.
    for result in in_flight:
        try:
            result.get(timeout=20)
        except Exception:
            consumer = app.app.backend.result_consumer
            print("DEBUG subscribed", consumer.subscribed_to, consumer._pubsub and consumer._pubsub.connection)
            with replicated.replica.client(BACKEND_DB) as c:
                print("DEBUG channels", c.pubsub_channels(), c.client_list())
            raise
        assert result.get(timeout=60).startswith("done by")
        meta = stored(cluster, result.id)
        assert meta is not None and meta["fence_token"] == cluster.runs(result.id)[-1]["token"]
    # The zombie started before the failover; its owner lost the lease; the new owner's token
    # is above every token handed out before, and the zombie's late write is refused.
    runs = cluster.wait_runs(zombie.id, 2, timeout=40)
    assert zombie.get(timeout=30) == f"owner {runs[-1]['token']} across"
    assert runs[-1]["token"] > max([*before, row_fence])
    cluster.wake(zombie.id)
    wait_until(lambda: cluster.record.llen(f"lost:{zombie.id}") == 1, 30, "the zombie to find its lease lost")
    meta = stored(cluster, zombie.id)
    assert meta is not None and meta["status"] == "SUCCESS" and meta["fence_token"] == runs[-1]["token"]
    assert lease(cluster, zombie.id)["status"] == "DONE"
    print(f"failover: the first task sent after the primary was killed finished {recovery:.1f} s after it")


def test_a_first_failover_to_a_replica_that_never_received_the_counter_hands_out_later_tokens(
    failover_cluster: Cluster, replicated: ReplicatedRedis
) -> None:
    cluster = failover_cluster
    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    replicated.wait_replicated()  # the worker's queues, not one token: the counter is not there yet
    assert not cluster.results.exists(KEYS.token)
    replicated.proxy.hold()
    lost_ones = [app.fenced_add.delay(n, 2) for n in range(10)]
    all_succeed(cluster, lost_ones, 30)
    before = tokens_of(cluster, [r.id for r in lost_ones])

    replicated.kill_primary()
    first_after = app.fenced_add.apply_async((100, 1), retry_policy=THROUGH_A_FAILOVER)
    assert first_after.get(timeout=60) == 101
    replicated.wait_promoted()
    with replicated.replica.client(BACKEND_DB) as promoted:
        assert not promoted.exists(KEYS.result(lost_ones[0].id))  # the writes were lost indeed

    after_ones = [app.fenced_add.delay(n, 3) for n in range(10)]
    all_succeed(cluster, after_ones, 30)
    after = tokens_of(cluster, [first_after.id] + [r.id for r in after_ones])
    assert min(after) > max(before), (before, after)
