"""Faults around ``Task.replace()`` (the hand-off) on real workers.

The owner writes its hand-off (``release.lua``), Celery sends the replacement, and the owner
says it sent it (``replacement_sent.lua``). These tests put a fault between those steps: an
owner held there while its worker lives on (never taken over); a whole worker frozen there and
thawed after the takeover (on prefork and on gevent; a lone task, a chord member); a
replacement that itself replaces, killed between its hand-off and its send; a lease that
vanished right before the hand-off.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import chord

from tests.integration.conftest import Cluster, lease, stored
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.integration

FREEZE = {"FENCED_TEST_FREEZE_ON_PUBLISH": "1"}

#: The test app's settings the waits below are made of (tests/integration/apps/fenced_app.py).
LEASE_TTL_MS, REQUEUE_TIMEOUT_MS, REAPER_INTERVAL_MS = 3_000, 5_000, 1_000


def replacement_runs(cluster: Cluster, origin: str) -> list[dict[str, Any]]:
    """Each run of a replacement's steps, recorded under the replaced task id."""
    return [json.loads(x) for x in cluster.record.lrange(f"replacement-runs:{origin}", 0, -1)]


def step_names(cluster: Cluster, origin: str) -> list[str]:
    """The names of the replacement's steps that ran, one per run, sorted."""
    return sorted(run["name"] for run in replacement_runs(cluster, origin))


@contextlib.contextmanager
def frozen_while_sending(cluster: Cluster, task_id: str) -> Iterator[int]:
    """The owner of ``task_id`` stops (SIGSTOP: its process on prefork, the whole worker on
    gevent) as it sends the first message of its replacement, after its hand-off; it is thawed
    when the block ends. Yields its pid once it stopped."""
    frozen = wait_until(lambda: cluster.record.lrange(f"frozen-publish:{task_id}", 0, -1), 20, "the frozen send")
    pid = int(frozen[0])
    try:
        assert lease(cluster, task_id)["status"] == "HANDED_OFF"
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_for_the_late_send(workers: list[CeleryProcess], delivered: Callable[[str], bool]) -> None:
    """Wait until the thawed owner's late send was delivered: ``delivered`` is given what the
    workers logged from now on (a refused delivery says ``[<task id>] not run``)."""
    marks = [len(worker.log()) for worker in workers]

    def since() -> str:
        return "".join(worker.log()[mark:] for worker, mark in zip(workers, marks, strict=True))

    wait_until(lambda: delivered(since()), 30, "the late replacement to be delivered")


@pytest.mark.parametrize(
    ("kind", "steps", "expected"),
    [
        pytest.param("plain", ["plain"], "plain", id="plain"),
        pytest.param("chain", ["first", "last"], "last", id="chain"),
    ],
)
def test_a_live_worker_whose_owner_is_held_between_its_hand_off_and_the_send_is_not_taken_over(
    cluster: Cluster, kind: str, steps: list[str], expected: str
) -> None:
    """docs/guarantees.rst, *Hand-off*: a live owner is never taken over for a slow send. The
    prefork process that handed off is held (SIGSTOP) as it sends its replacement, long past
    every deadline a takeover could keep (the lease TTL, the requeue timeout, reaper passes),
    while its worker's main process lives on and a free worker's reaper watches. Nothing takes
    the task over; thawed, the owner sends its replacement, whose steps (a plain task, a canvas
    step with an id of its own) run once."""
    app = cluster.app()
    first = cluster.worker("w1", concurrency=1, environ=FREEZE)
    signature = app.replaced_with.s(kind)
    task_id = signature.freeze().id
    cluster.record.set(f"freeze-publish:{task_id}", 1)
    result = signature.apply_async()
    with frozen_while_sending(cluster, task_id):
        second = cluster.worker("w2", concurrency=2)
        handed_off_at = int(lease(cluster, task_id)["handedOffAt"])
        past = handed_off_at + LEASE_TTL_MS + REQUEUE_TIMEOUT_MS + 3 * REAPER_INTERVAL_MS
        wait_until(lambda: cluster.results.time()[0] * 1000 > past, 30, "every deadline of a takeover")
        assert lease(cluster, task_id)["status"] == "HANDED_OFF"
        assert len(cluster.runs(task_id)) == 1
    assert result.get(timeout=30) == expected
    assert step_names(cluster, task_id) == steps
    assert len(cluster.runs(task_id)) == 1
    assert "re-sent (cause=" not in first.log() + second.log()


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_a_whole_worker_frozen_between_a_hand_off_and_the_send_has_its_replacement_sent_and_run_once(
    cluster: Cluster, pool: str
) -> None:
    """The whole worker freezes (a VM paused) right as its owner sends the replacement, after
    its hand-off: its liveness record lapses, and another worker's reaper sends the replacement
    the hand-off recorded. The replaced body does not run again; the thawed owner's late
    replacement is a copy that does not run, and the result is the replacement's."""
    app = cluster.app()
    first = cluster.worker("w1", pool=pool, concurrency=1, environ=FREEZE)
    signature = app.replaced_with.s("fenced")
    task_id = signature.freeze().id
    cluster.record.set(f"freeze-publish:{task_id}", 1)
    result = signature.apply_async()
    with frozen_while_sending(cluster, task_id):
        first.signal_group(signal.SIGSTOP)  # the main process too (on prefork): the whole worker
        try:
            second = cluster.worker("w2", concurrency=2)
            assert result.get(timeout=40) == "fenced"
            runs = cluster.runs(task_id)
            assert len(runs) == 1, runs
            assert step_names(cluster, task_id) == ["fenced"]
            assert "has not started: sent again" in second.log()
        finally:
            first.signal_group(signal.SIGCONT)
    wait_for_the_late_send(
        [first, second],
        lambda logged: f"[{task_id}] not run" in logged or len(replacement_runs(cluster, task_id)) > 1,
    )
    assert step_names(cluster, task_id) == ["fenced"], replacement_runs(cluster, task_id)
    assert len(cluster.runs(task_id)) == 1
    meta = stored(cluster, task_id)
    [last] = replacement_runs(cluster, task_id)
    assert meta is not None and meta["result"] == "fenced"
    assert meta["fence_token"] == last["token"] > runs[0]["token"]


def test_a_chord_member_whose_worker_froze_between_its_hand_off_and_the_send_counts_its_part_once(
    cluster: Cluster,
) -> None:
    """A chord header member replaces itself; its whole worker freezes as the owner sends the
    replacement, and the reaper sends the replacement the hand-off recorded. It counts the
    member's chord part: the chord body runs once, with the replacement's result; the thawed
    owner's late replacement (a copy) neither runs nor counts the part again."""
    app = cluster.app()
    first = cluster.worker("w1", concurrency=1, environ=FREEZE)
    member = app.replaced_with.s("fenced")
    task_id = member.freeze().id
    cluster.record.set(f"freeze-publish:{task_id}", 1)
    result = chord([member, app.fenced_add.s(1, 2)])(app.collected.s())
    with frozen_while_sending(cluster, task_id):
        first.signal_group(signal.SIGSTOP)
        try:
            second = cluster.worker("w2", concurrency=2)
            assert result.get(timeout=40) == ["fenced", 3]
            assert len(cluster.runs(task_id)) == 1
        finally:
            first.signal_group(signal.SIGCONT)
    wait_for_the_late_send(
        [first, second],
        lambda logged: f"[{task_id}] not run" in logged or len(replacement_runs(cluster, task_id)) > 1,
    )
    assert step_names(cluster, task_id) == ["fenced"]
    [body_run] = cluster.runs(result.id)
    assert body_run["values"] == ["fenced", 3]
    assert stored(cluster, result.id)["result"] == ["fenced", 3]  # type: ignore[index]


def test_a_replacement_killed_between_its_own_hand_off_and_the_send_has_its_replacement_sent(
    cluster: Cluster,
) -> None:
    """Two hand-offs: the task replaces itself by level 2, which replaces itself again. Level 2's
    process is killed between its hand-off and the send: Celery's ``WorkerLostError`` comes from
    a message that names the first hand-off's token, while the record holds the second's. The
    reaper sends the replacement the second hand-off recorded, and it runs once. Neither level 1
    nor level 2 runs again."""
    app = cluster.app()
    worker = cluster.worker("w1", concurrency=2, environ=FREEZE)
    result = app.replaced_twice.delay(1)
    task_id = result.id
    wait_until(lambda: cluster.record.llen(f"holding:{task_id}") == 1, 20, "level 2 to hold")
    cluster.record.set(f"freeze-publish-of:{task_id}", 1)  # level 2 stops as it sends its replacement
    cluster.wake(task_id)
    frozen = wait_until(lambda: cluster.record.lrange(f"frozen-publish-of:{task_id}", 0, -1), 20, "the frozen send")
    pid = int(frozen[0])
    record = lease(cluster, task_id)
    level_1, level_2 = cluster.runs(task_id)
    assert record["status"] == "HANDED_OFF" and record["handoffToken"] == str(level_2["token"])
    assert record["handoffPrior"] == str(level_1["token"])
    os.kill(pid, signal.SIGKILL)
    assert result.get(timeout=40) == "second"
    runs = cluster.runs(task_id)
    assert [run["level"] for run in runs] == [1, 2], runs
    [replacement] = replacement_runs(cluster, task_id)
    assert replacement["name"] == "second" and replacement["token"] > level_2["token"]
    meta = stored(cluster, task_id)
    assert meta is not None and meta["fence_token"] == replacement["token"]
    assert "has not started: sent again" in worker.log()


def test_a_lease_that_vanished_right_before_the_hand_off_still_ends_the_task(cluster: Cluster) -> None:
    """docs/guarantees.rst: a lease hash that vanished (a lost write, an eviction, a ``FLUSH``)
    is written back by its live owner, so the task finishes. Here it vanishes after the last
    renewal and right before ``replace()``: the owner is live and renewed less than a TTL ago."""
    app = cluster.app()
    cluster.worker("w1", concurrency=2)
    signature = app.replaced_with.s("fenced")
    task_id = signature.freeze().id
    cluster.record.set(f"vanish-before-replace:{task_id}", 1)
    result = signature.apply_async()
    assert result.get(timeout=20) == "fenced"
    [replacement] = replacement_runs(cluster, task_id)
    meta = stored(cluster, task_id)
    assert meta is not None and meta["fence_token"] == replacement["token"]


def test_a_base_exception_escaping_the_send_takes_the_hand_off_back(cluster: Cluster) -> None:
    """A BaseException out of the replacement's send (SystemExit here; an interrupt, gevent's
    hard time limit): the owner takes its hand-off back, so the body's end is its own. On the
    threads pool a SystemExit leaves the process alive and Celery stores nothing: the lease
    lapses as for any body that never finished, and the task is taken over and replaced anew."""
    app = cluster.app()
    worker = cluster.worker("w1", pool="threads", concurrency=2, environ=FREEZE)
    signature = app.replaced_with.s("fenced")
    task_id = signature.freeze().id
    cluster.record.set(f"exit-on-publish-of:{task_id}", 1)
    result = signature.apply_async()
    assert result.get(timeout=40) == "fenced"
    assert len(cluster.runs(task_id)) == 2
    assert step_names(cluster, task_id) == ["fenced"]
    assert "taken back" in worker.log()
