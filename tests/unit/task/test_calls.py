"""Attempt ids, and the call recorded at acquire: what ``signature_from_request()`` gives, for every request shape."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

from celery_fenced import ProgressLeasedTask
from celery_fenced._celery.compat import get_actual_ignore_result
from celery_fenced._task.calls import recorded_call

app = Celery("call_record", set_as_current=False)


@app.task(bind=True, base=ProgressLeasedTask, shared=False)
def job(self: Any, *args: Any, **kwargs: Any) -> None:
    """A task whose requests are recorded."""


LINK = {"task": "proj.next", "args": [], "kwargs": {}, "options": {}, "subtask_type": None, "immutable": False}

REQUESTS = {
    "default exchange": dict(delivery_info={"exchange": "", "routing_key": "celery", "priority": 0}),
    "named exchange": dict(delivery_info={"exchange": "tasks", "routing_key": "reports.pdf", "priority": None}),
    "no delivery info": dict(delivery_info=None),
    "canvas and limits": dict(
        delivery_info={"exchange": "", "routing_key": "long", "priority": 9, "redelivered": False},
        callbacks=[LINK],
        errbacks=[LINK],
        chain=[LINK],
        chord={"task": "proj.join", "options": {}},
        group="g1",
        group_index=2,
        timelimit=(60, 50),
        expires="2030-01-01T00:00:00+00:00",
        headers={"x-death": [{"count": 1}], "tenant": "a"},
        root_id="root",
        parent_id="parent",
        retries=3,
        reply_to="reply",
        origin="gen1@host",
        ignore_result=True,
        stamped_headers=["tenant"],
        stamps={"tenant": "a"},
    ),
}


@pytest.mark.parametrize("shape", REQUESTS)
def test_recorded_call_is_signature_from_request_without_none_options(shape: str) -> None:
    request = Context(id="t1", args=(1, "two"), kwargs={"three": 3}, **REQUESTS[shape])
    expected = dict(job.signature_from_request(request))
    # Celery 5.7's signature carries the effective ignore_result; the recorded call does on every version.
    expected["options"].setdefault("ignore_result", get_actual_ignore_result(job, request))
    recorded = recorded_call(job, request)
    assert recorded is not None
    assert recorded["task"] == expected["task"] == job.name
    assert recorded["args"] == list(expected["args"])
    assert recorded["kwargs"] == expected["kwargs"]
    assert recorded["options"] == {k: v for k, v in expected["options"].items() if v is not None}


def test_a_request_that_cannot_be_recorded_gives_none_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Context):
        def as_execution_options(self) -> dict[str, Any]:
            raise RuntimeError("broken request")

    assert recorded_call(job, Broken(id="t2", args=(), kwargs={})) is None
    assert "could not record the call of task t2" in caplog.text


def test_attempt_ids_are_unique_across_threads_and_forks() -> None:
    import os
    from concurrent.futures import ThreadPoolExecutor

    from celery_fenced._task.calls import AttemptIds

    next_attempt_id = AttemptIds().next_id
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: next_attempt_id(), range(2000)))
    assert len(set(ids)) == len(ids)
    assert all(i.startswith(f"{os.getpid()}/") for i in ids)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child reports its first id and exits at once
        os.write(write, next_attempt_id().encode())
        os._exit(0)
    os.waitpid(child, 0)
    child_id = os.read(read, 100).decode()
    os.close(read)
    os.close(write)
    assert child_id.startswith(f"{child}/")
    assert child_id.split("/")[1][:8] != ids[0].split("/")[1][:8]  # a new random part in the fork


def test_the_replacement_that_runs_under_the_task_id_names_the_hand_off() -> None:
    from celery import Celery, chain, group

    from celery_fenced._celery.headers import HANDED_OFF_BY_HEADER, PUBLISH_ID_HEADER
    from celery_fenced._task.calls import mark_replacement

    app = Celery("calls", set_as_current=False)

    @app.task(shared=False)
    def step(x: int = 0) -> int:
        return x

    marked = {HANDED_OFF_BY_HEADER: "7", PUBLISH_ID_HEADER: "p1"}
    single = step.s(1)
    single.freeze("t1")
    assert mark_replacement(single, "t1", "p1", 7) and single.options["headers"] == marked
    steps = chain(step.s(1), step.s(2))
    steps.freeze("t2")
    assert mark_replacement(steps, "t2", "p1", 7)
    assert steps.tasks[-1].options["headers"] == marked
    # The first step, an id of its own: named a publish of the run, the same each time it is
    # named (a re-send of the recorded replacement is a copy of it, not a new run).
    first = steps.tasks[0].options["headers"]
    assert set(first) == {PUBLISH_ID_HEADER} and first[PUBLISH_ID_HEADER] != "p1"
    again = chain(step.s(1), step.s(2))
    again.freeze("t2")
    again.tasks[0].options["task_id"] = steps.tasks[0].options["task_id"]
    mark_replacement(again, "t2", "p1", 7)
    assert again.tasks[0].options["headers"] == first
    fanned = group(step.s(1), step.s(2)) | step.s()  # a group replaced: a chord, its body under the id
    fanned.freeze("t3")
    assert mark_replacement(fanned, "t3", "", 7)
    assert fanned.body.options["headers"] == {HANDED_OFF_BY_HEADER: "7"}
    # With the run's publish id: the header's tasks are named publishes of the run, the group
    # and the chord themselves are not (Celery passes a canvas's headers down to every task in
    # it, and the body's hand-off header would be lost: its write refused as foreign).
    fanned = group(step.s(1), step.s(2)) | step.s()
    fanned.freeze("t5")
    assert mark_replacement(fanned, "t5", "p1", 7)
    assert fanned.body.options["headers"] == marked
    assert "headers" not in fanned.tasks.options and "headers" not in fanned.options
    assert all(set(task.options["headers"]) == {PUBLISH_ID_HEADER} for task in fanned.tasks.tasks)
    assert not mark_replacement(step.s(1), "t4", "p1", 7)
    app.close()
