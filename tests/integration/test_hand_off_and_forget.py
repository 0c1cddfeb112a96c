"""A hand-off (``Task.replace()``) and ``AsyncResult.forget()`` never let a task run twice.

Each test failed before its fix: a frozen owner's replace after a takeover sent a second
replacement, a copy of the replaced message ran the task again once the replacement had
finished, and a late copy of a forgotten task's message ran it again.
"""

from __future__ import annotations

import signal
import uuid

import pytest
from kombu.exceptions import EncodeError

from celery_fenced._celery.headers import PUBLISH_ID_HEADER
from tests.integration.conftest import KEYS, Cluster, lease, stored
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration


def delivered_again(cluster: Cluster, worker_log: str, task_id: str, runs: int) -> bool:
    """A copy of ``task_id``'s message was delivered: refused (the worker says why), or run."""
    return f"[{task_id}] not run:" in worker_log or len(cluster.runs(task_id)) > runs


def test_an_owner_that_lost_its_lease_sends_no_replacement(cluster: Cluster) -> None:
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1)
    result = app.replaced_after_hold.delay()
    wait_until(lambda: cluster.record.llen(f"holding:{result.id}") == 1, 20, "the first owner to hold")
    cluster.worker("w2", concurrency=1)
    cluster.beat()
    w1.signal_group(signal.SIGSTOP)  # heartbeat and body frozen together
    try:
        runs = cluster.wait_runs(result.id, 2, timeout=30)  # taken over after the TTL
        assert runs[1]["hostname"].startswith("w2@")
        assert result.get(timeout=20) == runs[1]["token"]  # the new owner's replacement ran
        cluster.wake(result.id)
    finally:
        w1.signal_group(signal.SIGCONT)

    def replaced(outcome: str) -> list[int]:
        return [int(token) for token in cluster.record.lrange(f"{outcome}:{result.id}", 0, -1)]

    wait_until(lambda: len(replaced("replace-sent") + replaced("replace-refused")) == 2, 20, "the thawed replace()")
    assert replaced("replace-sent") == [runs[1]["token"]]
    assert replaced("replace-refused") == [runs[0]["token"]]  # the frozen owner sent nothing
    assert cluster.record.lrange(f"replacement:{result.id}", 0, -1) == [f"from-token={runs[1]['token']}"]
    assert stored(cluster, result.id)["result"] == runs[1]["token"]  # type: ignore[index]


def test_a_replacement_that_cannot_be_sent_fails_the_task_as_in_celery(cluster: Cluster) -> None:
    """Plain Celery stores the send's error as the task's FAILURE. The hand-off had already
    made the lease a record that refused that write: the task never ended, get() hung."""
    app = cluster.app()
    cluster.worker("w1")
    result = app.replaced_by.delay("unsendable")
    with pytest.raises(EncodeError):
        result.get(timeout=20)
    [run] = cluster.runs(result.id)
    meta = stored(cluster, result.id)
    assert meta is not None and meta["status"] == "FAILURE" and meta["fence_token"] == run["token"]
    assert lease(cluster, result.id)["status"] == "DONE"
    assert cluster.record.lrange(f"replacement:{result.id}", 0, -1) == []


def test_a_copy_of_the_replaced_message_does_not_run(cluster: Cluster) -> None:
    app = cluster.app()
    w1 = cluster.worker("w1")
    headers = {PUBLISH_ID_HEADER: uuid.uuid4().hex[:16]}  # the original message's, kept by a copy
    result = app.replaced_by.apply_async(("fenced",), headers=headers)
    assert result.get(timeout=20) == 5
    assert len(cluster.runs(result.id)) == 1
    app.replaced_by.apply_async(("fenced",), task_id=result.id, headers=headers)  # a late copy
    wait_until(lambda: delivered_again(cluster, w1.log(), result.id, 1), 20, "the copy to be delivered")
    assert len(cluster.runs(result.id)) == 1
    assert stored(cluster, result.id)["result"] == 5  # type: ignore[index]


def test_a_forgotten_task_does_not_run_again_from_a_late_copy(cluster: Cluster) -> None:
    app = cluster.app()
    w1 = cluster.worker("w1")
    headers = {PUBLISH_ID_HEADER: uuid.uuid4().hex[:16]}
    result = app.noted_add.apply_async((1, 2), headers=headers)
    assert result.get(timeout=20) == 3
    result.forget()
    assert stored(cluster, result.id) is None
    app.noted_add.apply_async((1, 2), task_id=result.id, headers=headers)  # a late copy
    wait_until(lambda: delivered_again(cluster, w1.log(), result.id, 1), 20, "the copy to be delivered")
    assert len(cluster.runs(result.id)) == 1
    # What refused it: a DONE tombstone, which expires (a bounded cost per forgotten task).
    tombstone = lease(cluster, result.id)
    assert tombstone["status"] == "DONE" and "forgottenAt" in tombstone
    assert 0 < cluster.results.pttl(KEYS.lease(result.id)) <= 3600_000
