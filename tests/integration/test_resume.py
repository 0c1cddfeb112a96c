"""Resume on takeover: the next owner starts from the details its predecessor published.

Each batch's execution is recorded with the token that ran it, so the tests count what was
done again: a takeover must redo nothing the old owner had published as done.
"""

from __future__ import annotations

import json
import signal

import pytest

from tests.integration.conftest import Cluster, lease, stored
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration


def executed(cluster: Cluster, task_id: str) -> list[tuple[int, int]]:
    """(batch, token) of every batch execution, in order."""
    return [tuple(json.loads(x)) for x in cluster.record.lrange(f"batches:{task_id}", 0, -1)]  # type: ignore[misc]


def details(cluster: Cluster, task_id: str) -> dict:  # type: ignore[type-arg]
    text = lease(cluster, task_id).get("details")
    return json.loads(text) if text else {}


@pytest.mark.parametrize("pool", ["prefork", "threads", "gevent"])
def test_a_stalled_owner_is_resumed_after_its_last_published_batch(cluster: Cluster, pool: str) -> None:
    app = cluster.app()
    w1 = cluster.worker("w1", pool=pool, concurrency=1)
    result = app.batches.delay(10, stall_after=6, pause=0.3)
    [first] = cluster.wait_runs(result.id, 1)
    assert first["resumed_from"] == 0 and first["checkpoint"] is None  # a first attempt
    cluster.worker("w2", pool=pool, concurrency=1)
    cluster.beat()
    runs = cluster.wait_runs(result.id, 2, timeout=30)
    second = runs[1]
    assert second["hostname"].startswith("w2@")
    assert second["resumed_from"] == 6
    assert second["checkpoint"] == ["process", {"done": 6}, 1, first["token"]]

    # The zombie wakes while the new owner works: its progress is refused, its details never land.
    cluster.wake(result.id)
    lost = wait_until(lambda: cluster.record.lrange(f"lost:{result.id}", 0, -1), 15, "the zombie's progress to raise")
    assert lost
    assert details(cluster, result.id).get("done") != 99

    assert result.get(timeout=20) == f"10 batches by {second['token']}"
    assert executed(cluster, result.id) == [(n, first["token"]) for n in range(1, 7)] + [
        (n, second["token"]) for n in range(7, 11)
    ], "a batch ran twice, or one was skipped"
    wait_until(lambda: "stale write dropped" in w1.log(), 15, "the zombie's write to be refused")
    meta = stored(cluster, result.id)
    assert meta is not None and meta["fence_token"] == second["token"]
    assert details(cluster, result.id) == {}  # a finished lease keeps no details: its result says it all


def test_a_killed_owners_last_published_details_reach_the_next_owner(cluster: Cluster) -> None:
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    result = app.batches.delay(12, pause=0.3)
    [first] = cluster.wait_runs(result.id, 1)
    wait_until(lambda: details(cluster, result.id).get("done", 0) >= 4, 15, "four batches to be published")
    w1.signal_group(signal.SIGKILL)
    wait_until(lambda: w1.proc.poll() is not None, 10, "the worker to die")
    published = details(cluster, result.id)["done"]
    cluster.worker("w2", concurrency=1)
    cluster.beat()
    runs = cluster.wait_runs(result.id, 2, timeout=30)
    assert runs[1]["resumed_from"] == published
    assert runs[1]["checkpoint"] == ["process", {"done": published}, 1, first["token"]]
    assert result.get(timeout=20) == f"12 batches by {runs[1]['token']}"
    by_new_owner = [batch for batch, token in executed(cluster, result.id) if token == runs[1]["token"]]
    assert by_new_owner == list(range(published + 1, 13))
    by_old_owner = [batch for batch, token in executed(cluster, result.id) if token == first["token"]]
    # What the old owner did after its last publication (at most one heartbeat) is done again.
    assert by_old_owner[:published] == list(range(1, published + 1)) and len(by_old_owner) <= published + 3


def test_a_retry_starts_from_the_details_published_before_it(cluster: Cluster) -> None:
    app = cluster.app()
    cluster.worker("w1", concurrency=1)
    result = app.retried_from_checkpoint.delay()
    assert result.get(timeout=20) == "retried"
    first, retry = cluster.runs(result.id)
    assert first["retries"] == 0 and first["checkpoint"] is None
    # A retry is told apart from a takeover by Celery's own count: request.retries moved on.
    assert retry["retries"] == 1
    assert retry["checkpoint"] == ["fetch", {"page": 3}, 1, first["token"]]
