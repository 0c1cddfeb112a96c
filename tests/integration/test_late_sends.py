"""What an owner sends after its body returned (link callbacks, a chain's next step), when it
is frozen between its last lease check and the send and taken over meanwhile.

Celery sends callbacks and the next chain step *before* it stores the result, so the fence
on the result cannot stop them; the owner checks its lease once the body returned
(``still_owner``), and a pause right after that check lets a zombie send them late.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import pytest
from celery import chain

from tests.integration.conftest import Cluster, lease, stored
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration

FREEZE = {"FENCED_TEST_FREEZE_ON_PUBLISH": "1"}


def test_an_owner_frozen_while_sending_the_next_chain_step_does_not_run_it_twice(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, environ=FREEZE)
    flow = chain(app.chain_step.si("a"), app.chain_step.si("b"))
    result = flow.freeze()
    first_id, next_id = result.parent.id, result.id
    cluster.record.set(f"freeze-publish:{first_id}", 1)  # a's first owner stops as it sends b
    flow.apply_async()
    frozen = wait_until(lambda: cluster.record.lrange(f"frozen-publish:{first_id}", 0, -1), 20, "the frozen send")
    pid = int(frozen[0])  # type: ignore[index]
    try:
        # Its lease expires; the reaper re-sends a, whose new owner sends b, which finishes.
        runs = cluster.wait_runs(first_id, 2, timeout=20)
        assert result.get(timeout=20) == "b"
    finally:
        os.kill(pid, signal.SIGCONT)
    # The zombie's send goes out now; its own result is refused.
    wait_until(lambda: "stale write dropped" in worker.log(), 15, "the zombie's write to be refused")
    wait_until(
        lambda: f"[{next_id}] not run" in worker.log() or len(cluster.runs(next_id)) > 1,
        15,
        "the zombie's copy of the next step to be delivered",
    )
    assert len(cluster.runs(next_id)) == 1, cluster.runs(next_id)
    assert cluster.record.llen("chain:b") == 1
    meta = stored(cluster, first_id)
    assert meta is not None and meta["fence_token"] == runs[1]["token"]
    assert lease(cluster, next_id)["attempt"] == "1"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_an_owner_frozen_while_sending_its_link_callback_does_not_run_it_twice(cluster: Cluster) -> None:
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, environ=FREEZE)
    first = app.chain_step.si("link-a")
    first.freeze()
    cluster.record.set(f"freeze-publish:{first.id}", 1)  # a's first owner stops as it sends its callback
    first.apply_async(link=app.chain_step.si("link-b"))  # the callback's id is chosen as it is sent
    frozen = wait_until(lambda: cluster.record.lrange(f"frozen-publish:{first.id}", 0, -1), 20, "the frozen send")
    pid = int(frozen[0])  # type: ignore[index]
    try:
        runs = cluster.wait_runs(first.id, 2, timeout=20)
        wait_until(lambda: cluster.record.llen("chain:link-b") >= 1, 20, "the new owner's callback")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: "stale write dropped" in worker.log(), 15, "the zombie's write to be refused")
    [callback_id] = cluster.record.lrange("chain:link-b", 0, 0)
    wait_until(
        lambda: worker.log().count(f"[{callback_id}] not run") or cluster.record.llen("chain:link-b") > 1,
        15,
        "the zombie's copy of the callback to be delivered",
    )
    assert cluster.record.lrange("chain:link-b", 0, -1) == [callback_id]
    meta = stored(cluster, first.id)
    assert meta is not None and meta["fence_token"] == runs[1]["token"]


def test_an_owner_frozen_while_sending_its_retry_leaves_the_retry_to_run_once(cluster: Cluster) -> None:
    """The owner moved its lease to RETRYING and froze before its retry message went out: the
    reaper sends the retry (its arguments and retries) once it is overdue, and the late retry
    message of the thawed owner is a copy of it, which does not run; its RETRY is refused."""
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, environ=FREEZE)
    signature = app.retry_with_cursor.s(0, 1)
    task_id = signature.freeze().id
    cluster.record.set(f"freeze-publish-of:{task_id}", 1)
    result = signature.apply_async()
    frozen = wait_until(lambda: cluster.record.lrange(f"frozen-publish-of:{task_id}", 0, -1), 20, "the frozen retry")
    pid = int(frozen[0])  # type: ignore[index]
    try:
        assert result.get(timeout=30) == "cursor 1 after 1 retries"
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: f"RETRY of task {task_id} not stored" in worker.log(), 15, "the zombie's RETRY to be refused")
    wait_until(
        lambda: f"[{task_id}] not run" in worker.log() or len(cluster.runs(task_id)) > 2,
        15,
        "the zombie's retry message to be delivered",
    )
    runs = cluster.runs(task_id)
    assert [(run["cursor"], run["retries"]) for run in runs] == [(0, 0), (1, 1)], runs
    meta = stored(cluster, task_id)
    assert meta is not None and meta["fence_token"] == runs[1]["token"]


def test_an_owner_killed_between_its_hand_off_and_the_send_has_its_replacement_sent_again(cluster: Cluster) -> None:
    """``Task.replace()``: the hand-off is written, with the replacement, then the replacement
    is sent. A process killed in between (an OOM kill) sent nothing: the reaper sends the
    recorded replacement once it has not started within the requeue timeout, instead of
    waiting as HANDED_OFF for ever; the replaced body does not run again."""
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, environ=FREEZE)
    signature = app.replaced_by.s("fenced")
    task_id = signature.freeze().id
    cluster.record.set(f"freeze-publish-of:{task_id}", 1)  # stops as it sends the replacement
    result = signature.apply_async()
    frozen = wait_until(lambda: cluster.record.lrange(f"frozen-publish-of:{task_id}", 0, -1), 20, "the frozen send")
    assert lease(cluster, task_id)["status"] == "HANDED_OFF"
    os.kill(int(frozen[0]), signal.SIGKILL)  # type: ignore[index]
    assert result.get(timeout=30) == 5
    assert len(cluster.runs(task_id)) == 1
    assert "has not started: sent again" in worker.log()


def test_a_whole_worker_killed_between_its_hand_off_and_the_send_has_its_replacement_sent_again(
    cluster: Cluster,
) -> None:
    """No process of the worker is left to say anything (no ``WorkerLostError``): the hand-off's
    record, filed under the worker until its owner says it sent the replacement, is due once
    the worker's liveness lapses, and another worker's reaper sends the recorded replacement."""
    app = cluster.app()
    first = cluster.worker("w1", concurrency=2, environ=FREEZE)
    signature = app.replaced_by.s("fenced")
    task_id = signature.freeze().id
    cluster.record.set(f"freeze-publish-of:{task_id}", 1)  # stops as it sends the replacement
    result = signature.apply_async()
    wait_until(lambda: cluster.record.lrange(f"frozen-publish-of:{task_id}", 0, -1), 20, "the frozen send")
    assert lease(cluster, task_id)["status"] == "HANDED_OFF"
    first.signal_group(signal.SIGKILL)  # the main process and every child: nobody writes anything
    wait_until(lambda: first.proc.poll() is not None, 10, "the killed worker's exit")
    second = cluster.worker("w2", concurrency=2)
    assert result.get(timeout=30) == 5
    assert len(cluster.runs(task_id)) == 1
    assert "has not started: sent again" in second.log()
    meta = stored(cluster, task_id)
    assert meta is not None and meta["status"] == "SUCCESS"


def test_a_handing_process_killed_right_after_its_send_runs_no_step_twice(cluster: Cluster) -> None:
    """The process that handed off is killed right after Celery published its replacement and
    before it said so (an OOM kill), and the replacement (a chain whose first step has an id
    of its own) waits in its queue longer than the requeue timeout. The reaper sends the
    replacement the hand-off recorded (never the replaced body again): the late original and
    the re-sent copy are one publish of each step, and each step runs once."""
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, environ=FREEZE)
    signature = app.replaced_with.s("queued-chain")
    task_id = signature.freeze().id
    cluster.record.set(f"kill-after-publish:{task_id}", 1)
    result = signature.apply_async()
    wait_until(lambda: "sent again" in worker.log() or "re-sent (cause=" in worker.log(), 30, "the reaper's send")
    cluster.worker("w2", concurrency=1, queues="later")
    assert result.get(timeout=30) == "last"
    wait_until(lambda: "not run" in cluster.logs(), 20, "the copy of the first step to be refused")
    steps = sorted(json.loads(x)["name"] for x in cluster.record.lrange(f"replacement-runs:{task_id}", 0, -1))
    assert steps == ["first", "last"]
    assert len(cluster.runs(task_id)) == 1  # the replaced body ran once


def test_a_replacement_sent_and_waiting_in_its_queue_is_not_taken_over(cluster: Cluster) -> None:
    """The owner said it sent its replacement: however long the replacement waits for a worker
    (here a queue nobody consumes until later), the reaper leaves the hand-off alone, and the
    replaced body does not run again."""
    app = cluster.app()
    first = cluster.worker("w1", concurrency=2)
    result = app.replaced_by.delay("queued")
    record = wait_until(
        lambda: (found := lease(cluster, result.id)).get("handoffSent") == "1" and found, 20, "the sent hand-off"
    )
    assert record["status"] == "HANDED_OFF"  # type: ignore[index]
    # Past the moment an unsent hand-off would be due (the requeue timeout), and three passes
    # of the reaper beyond it, on the server's clock.
    due_ms = int(record["handedOffAt"]) + 5_000 + 3 * 1_000  # type: ignore[index]
    wait_until(lambda: cluster.results.time()[0] * 1000 > due_ms, 20, "the would-be due time")
    assert lease(cluster, result.id)["status"] == "HANDED_OFF"
    assert "re-sent (cause=gone" not in first.log()
    cluster.worker("w2", concurrency=1, queues="later")
    assert result.get(timeout=30) == 5
    assert len(cluster.runs(result.id)) == 1  # the replaced body ran once


def test_a_task_id_sent_again_after_the_body_runs_again(cluster: Cluster) -> None:
    # The same task id applied twice by one run after its body (on_success, after_return, a
    # task_postrun receiver), the second once the first finished: Celery runs both, and so
    # does a fenced task id applied twice from inside the body (another publish, a new run).
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2)
    parent = app.sends_twice_after_body.delay()
    assert parent.get(timeout=20) == "sent"
    child_id = f"{parent.id}-child"
    wait_until(
        lambda: f"[{child_id}] not run" in worker.log() or len(cluster.runs(child_id)) >= 2,
        30,
        "the second send to be delivered",
    )
    assert len(cluster.runs(child_id)) == 2, worker.log()
