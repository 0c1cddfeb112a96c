"""Faults around ``Task.replace()`` (the hand-off) on real workers.

The owner writes its hand-off (``release.lua``), Celery sends the replacement, and the owner
says it sent it (``replacement_sent.lua``). These tests put a fault between those steps: an
owner frozen for longer than ``fenced_requeue_timeout`` and thawed after the takeover (on
prefork and on gevent; a lone task, a chain step, a chord member); a replacement that itself
replaces, killed between its hand-off and its send; a lease that vanished right before the
hand-off.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import chain, chord

from tests.integration.conftest import Cluster, lease, stored
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.integration

FREEZE = {"FENCED_TEST_FREEZE_ON_PUBLISH": "1"}

# Why a frozen owner's late replacement still runs in part (the xfail cases below).
LATE_REPLACEMENT_RUNS = (
    "claim.lua undoes a hand-off its owner has not said it sent once fenced_requeue_timeout "
    "passed, and cannot tell a lost owner from a held one; the replaced body runs again and sends "
    "a second replacement. The thawed owner's late send is refused only for a fenced task under "
    "the replaced task id (acquire.lua: its fenced_handed_off_by, or its publish id once the run "
    "finished). A plain task takes no lease and runs; a step of a replacement canvas with an id "
    "of its own is a new task id to the lease and runs"
)


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
    ("pool", "kind", "steps", "expected"),
    [
        pytest.param("prefork", "fenced", ["fenced"], "fenced", id="prefork-fenced"),
        pytest.param("gevent", "fenced", ["fenced"], "fenced", id="gevent-fenced"),
        pytest.param(
            "prefork",
            "plain",
            ["plain"],
            "plain",
            id="prefork-plain",
            marks=pytest.mark.xfail(strict=True, reason=LATE_REPLACEMENT_RUNS),
        ),
        pytest.param(
            "prefork",
            "chain",
            ["first", "last"],
            "last",
            id="prefork-chain",
            marks=pytest.mark.xfail(strict=True, reason=LATE_REPLACEMENT_RUNS),
        ),
    ],
)
def test_an_owner_frozen_between_its_hand_off_and_the_send_and_thawed_after_the_takeover(
    cluster: Cluster, pool: str, kind: str, steps: list[str], expected: str
) -> None:
    """docs/guarantees.rst, *Hand-off*: an owner held between its hand-off and the send for
    longer than the requeue timeout is taken over, and its late replacement does not run. The
    replaced body runs twice; each step of the replacement runs once, and the result is the
    newest owner's."""
    app = cluster.app()
    first = cluster.worker("w1", pool=pool, concurrency=1, environ=FREEZE)
    signature = app.replaced_with.s(kind)
    task_id = signature.freeze().id
    cluster.record.set(f"freeze-publish:{task_id}", 1)
    result = signature.apply_async()
    with frozen_while_sending(cluster, task_id):
        second = cluster.worker("w2", concurrency=2)
        assert result.get(timeout=40) == expected
        runs = cluster.runs(task_id)
        assert len(runs) == 2 and runs[1]["hostname"].startswith("w2@"), runs
        assert step_names(cluster, task_id) == steps
        late = len(steps)
    wait_for_the_late_send(
        [first, second],
        lambda logged: f"[{task_id}] not run" in logged or len(replacement_runs(cluster, task_id)) > late,
    )
    assert step_names(cluster, task_id) == steps, replacement_runs(cluster, task_id)
    assert len(cluster.runs(task_id)) == 2
    meta = stored(cluster, task_id)
    assert meta is not None and meta["status"] == "SUCCESS" and meta["result"] == expected
    if kind != "plain":
        [last] = [run for run in replacement_runs(cluster, task_id) if run["id"] == task_id]
        assert meta["fence_token"] == last["token"] > runs[1]["token"] > runs[0]["token"]


@pytest.mark.parametrize(
    "kind",
    [
        "fenced",
        pytest.param(
            "plain",
            marks=pytest.mark.xfail(
                strict=True,
                reason=LATE_REPLACEMENT_RUNS + ". The late plain replacement then sends the chain's next step "
                "(a fenced task) under a new publish id (tag_publish: a plain task holds no lease to derive "
                "it from), and acquire.lua runs a finished task id's delivery of another publish again",
            ),
        ),
    ],
)
def test_a_chain_step_frozen_between_its_hand_off_and_the_send_runs_the_next_step_once(
    cluster: Cluster, kind: str
) -> None:
    """A step of a chain replaces itself (Celery appends the rest of the chain to the
    replacement). Its owner freezes as it sends the replacement, is taken over, and thaws once
    the chain has finished: the chain's next step (a fenced task) ran once, and does not run
    again."""
    app = cluster.app()
    first = cluster.worker("w1", concurrency=1, environ=FREEZE)
    flow = chain(app.replaced_with.si(kind), app.chain_step.si("after"))
    result = flow.freeze()
    task_id, after_id = result.parent.id, result.id
    cluster.record.set(f"freeze-publish:{task_id}", 1)
    flow.apply_async()
    with frozen_while_sending(cluster, task_id):
        second = cluster.worker("w2", concurrency=2)
        assert result.get(timeout=40) == "after"
        assert len(cluster.runs(task_id)) == 2
        assert len(cluster.runs(after_id)) == 1
    # Refused, or run (and then it sends the next step, refused or run).
    wait_for_the_late_send(
        [first, second],
        lambda logged: (
            f"[{task_id}] not run" in logged or f"[{after_id}] not run" in logged or len(cluster.runs(after_id)) > 1
        ),
    )
    assert len(cluster.runs(after_id)) == 1, cluster.runs(after_id)
    assert step_names(cluster, task_id) == [kind]
    meta = stored(cluster, after_id)
    assert meta is not None and meta["result"] == "after"


def test_a_chord_member_frozen_between_its_hand_off_and_the_send_counts_its_part_once(cluster: Cluster) -> None:
    """A chord header member replaces itself; its owner freezes as it sends the replacement and
    is taken over. The new owner's replacement counts the member's chord part: the chord body
    runs once, with the replacement's result; the thawed owner's late replacement neither runs
    nor counts the part again."""
    app = cluster.app()
    first = cluster.worker("w1", concurrency=1, environ=FREEZE)
    member = app.replaced_with.s("fenced")
    task_id = member.freeze().id
    cluster.record.set(f"freeze-publish:{task_id}", 1)
    result = chord([member, app.fenced_add.s(1, 2)])(app.collected.s())
    with frozen_while_sending(cluster, task_id):
        second = cluster.worker("w2", concurrency=2)
        assert result.get(timeout=40) == ["fenced", 3]
        assert len(cluster.runs(task_id)) == 2
    wait_for_the_late_send(
        [first, second],
        lambda logged: f"[{task_id}] not run" in logged or len(replacement_runs(cluster, task_id)) > 1,
    )
    assert step_names(cluster, task_id) == ["fenced"]
    [body_run] = cluster.runs(result.id)
    assert body_run["values"] == ["fenced", 3]
    assert stored(cluster, result.id)["result"] == ["fenced", 3]  # type: ignore[index]


def test_a_replacement_killed_between_its_own_hand_off_and_the_send_is_taken_over_as_itself(
    cluster: Cluster,
) -> None:
    """Two hand-offs: the task replaces itself by level 2, which replaces itself again. Level 2's
    process is killed between its hand-off and the send: Celery's ``WorkerLostError`` comes from
    a message that names the first hand-off's token, while the record holds the second's. The
    reaper undoes the second hand-off only: the task id goes back to level 2 (``handoffPrior``),
    whose re-send runs (it names the first hand-off), hands off again, and the final
    replacement runs once. Level 1 does not run again."""
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
    assert [run["level"] for run in runs] == [1, 2, 2], runs
    assert runs[2]["attempt"] == 2 and runs[2]["token"] > level_2["token"]
    [replacement] = replacement_runs(cluster, task_id)
    assert replacement["name"] == "second" and replacement["token"] > runs[2]["token"]
    meta = stored(cluster, task_id)
    assert meta is not None and meta["fence_token"] == replacement["token"]
    assert "re-sent (cause=gone" in worker.log()


@pytest.mark.xfail(
    strict=True,
    reason="hand_off() (celery_fenced/_worker/lifecycle.py) takes release.lua's 'missing' as a lost "
    "lease: LeaseLostError, the body ends as Ignore, nothing is sent or stored, and the heartbeat "
    "(unregistered by _stop_serving) never writes the lease back; with no lease, no index entry and "
    "no result, nothing ever runs or ends the task. A lease that vanishes at any other moment of a "
    "live owner is written back (restore.lua)",
)
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
