"""The result-path matrix's tasks: one fenced task per Celery result path, and plain twins.

The tasks are registered on the integration tests' app (:mod:`tests.integration.apps.fenced_app`);
its workers import this module through the ``include`` of :data:`MATRIX_SETTINGS`, which also
shortens every lease time so a takeover takes a few seconds.

Every body records its steps in the record database, in the list ``steps:<task id>``: one JSON
entry per step an execution completed, with the token it held (``None`` for a plain task). A
step after the first is recorded only after a ``progress()`` that passed (an owner that lost
its lease stops there), so the checker counts how often each step's side effect happened.

A first attempt on the faulted worker ``w1`` *holds* while the scenario's fault is injected (``matrix:fault`` names it) and
until the test sets ``matrix:release``: under the ``stall`` fault it blocks without progress (so
its stage deadline passes and it is taken over), under the other faults it keeps progressing.
Woken, it goes on to its path's end as any late owner would.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from celery.exceptions import Ignore, Reject

from celery_fenced import ProgressLeasedTask
from tests.integration.apps.fenced_app import app, attempt_number, record, wait_for_key

#: The matrix's settings: short leases, so a stall, a freeze or a lost worker is taken over fast.
MATRIX_SETTINGS: dict[str, Any] = {
    "include": ["tests.matrix.app"],
    "fenced_lease_ttl": 2,
    "fenced_heartbeat_interval": 0.3,
    "fenced_default_stage_timeout": 1,
    "fenced_stage_timeouts": {},
    "fenced_reaper_interval": 1,
    "fenced_requeue_timeout": 4,
    "fenced_start_timeout": 6,
    "fenced_max_takeovers": 5,
}

RELEASE = "matrix:release"
#: The faulted worker's name: only its first attempts hold.
FAULTED = "w1"
FAULT = "matrix:fault"
#: How long a body that waits for a limit or a revoke runs at most, then returns.
LONG_BODY_SECONDS = 4.0


def mark(task: Any, step: str, **extra: Any) -> None:
    """Record that this execution completed ``step`` (with its token)."""
    token = getattr(task, "fencing_token", None) if isinstance(task, ProgressLeasedTask) else None
    entry = {
        "step": step,
        "token": token,
        "attempt": attempt_number(task) if isinstance(task, ProgressLeasedTask) else 0,
        "pid": os.getpid(),
        "hostname": task.request.hostname,
        "at": time.time(),
        **extra,
    }
    record().rpush(f"steps:{task.request.id}", json.dumps(entry))


def step(task: Any, name: str) -> None:
    """One step: progress (a fenced task's guard), then its side effect."""
    if isinstance(task, ProgressLeasedTask):
        task.progress(name)
    mark(task, name)


def held(task: Any) -> bool:
    """Whether this execution is a first attempt on the faulted worker (``w1``) before the release."""
    return (
        isinstance(task, ProgressLeasedTask)
        and (task.request.hostname or "").startswith(f"{FAULTED}@")
        and attempt_number(task) == 1
        and not record().exists(RELEASE)
    )


def hold(task: Any) -> None:
    """A first attempt on ``w1`` waits here while the fault is injected, until the test releases
    it (an attempt on the other worker goes on: a solo worker's one slot is never held)."""
    if not held(task):
        return
    fault = (record().get(FAULT) or b"").decode()
    if fault == "stall":
        wait_for_key(RELEASE, 90)  # no progress: the stage deadline passes, the lease is taken over
        return
    deadline = time.monotonic() + 90
    while not record().exists(RELEASE) and time.monotonic() < deadline:
        task.progress("hold")
        time.sleep(0.1)


def begin(task: Any) -> None:
    """The start step, then the hold."""
    step(task, "start")
    hold(task)


def run_for(task: Any, seconds: float) -> None:
    """Progress for ``seconds`` (a body a time limit or a revoke is to stop)."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        if isinstance(task, ProgressLeasedTask):
            task.progress("work")
        time.sleep(0.1)


def _exit(task: Any, how: str) -> None:
    mark(task, "exit", how=how)


class Exits:
    """Records how an execution left its body (``exit``), whatever ended it."""

    def __init__(self, task: Any) -> None:
        self.task = task

    def __enter__(self) -> Exits:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        with contextlib.suppress(BaseException):
            _exit(self.task, "returned" if kind is None else kind.__name__)


# -- the bodies, shared by the fenced tasks and their plain twins -----------------------------------


def body_success(task: Any) -> str:
    with Exits(task):
        begin(task)
        step(task, "finish")
        return "success"


def body_failure(task: Any) -> None:
    with Exits(task):
        begin(task)
        step(task, "finish")
        raise ValueError("matrix failure")


def body_retry(task: Any) -> str:
    with Exits(task):
        begin(task)
        if task.request.retries == 0:
            step(task, "retry")
            raise task.retry(countdown=0.5)
        step(task, "finish")
        return "retried"


def body_reject(task: Any) -> None:
    with Exits(task):
        begin(task)
        step(task, "finish")
        raise Reject("matrix reject", requeue=False)


def body_ignore(task: Any) -> None:
    with Exits(task):
        begin(task)
        step(task, "finish")
        raise Ignore()


def body_ignore_result(task: Any) -> str:
    with Exits(task):
        begin(task)
        step(task, "finish")
        return "ignored"


def body_long(task: Any) -> str:
    """Runs until a time limit stops it; returns after :data:`LONG_BODY_SECONDS`."""
    with Exits(task):
        begin(task)
        run_for(task, LONG_BODY_SECONDS)
        step(task, "finish")
        return "ran to its end"


def body_until_revoked(task: Any) -> str:
    """Runs until a revoke stops it: the test sets ``matrix:revoked:<id>`` once it revoked it;
    a body still running then (a pool that cannot terminate) returns after a moment."""
    with Exits(task):
        begin(task)
        deadline = time.monotonic() + 60
        while not record().exists(f"matrix:revoked:{task.request.id}") and time.monotonic() < deadline:
            run_for(task, 0.1)
        run_for(task, 1)
        step(task, "finish")
        return "ran to its end"


FENCED = {"bind": True, "base": ProgressLeasedTask, "interrupt_on_loss": False}


@app.task(**FENCED)
def path_success(self: Any) -> str:
    return body_success(self)


@app.task(**FENCED)
def path_failure(self: Any) -> None:
    body_failure(self)


@app.task(**FENCED)
def path_retry(self: Any) -> str:
    return body_retry(self)


@app.task(**FENCED)
def path_replace(self: Any) -> Any:
    """Replaced by another fenced task; a late owner tries to replace it too (no guard first)."""
    with Exits(self):
        begin(self)
        mark(self, "replace")
        return self.replace(path_replacement.s())


@app.task(**FENCED)
def path_replacement(self: Any) -> str:
    """The replacement: it runs under the replaced task's id."""
    with Exits(self):
        step(self, "replacement")
        return "replacement"


@app.task(**FENCED, acks_late=True)
def path_reject(self: Any) -> None:
    body_reject(self)


@app.task(**FENCED)
def path_ignore(self: Any) -> None:
    body_ignore(self)


@app.task(**FENCED, ignore_result=True)
def path_ignore_result(self: Any) -> str:
    return body_ignore_result(self)


@app.task(**FENCED)
def path_revoke(self: Any) -> str:
    """Revoked before it is sent: never runs."""
    return body_success(self)


@app.task(**FENCED)
def path_revoke_terminate(self: Any) -> str:
    return body_until_revoked(self)


@app.task(**FENCED, soft_time_limit=1.5)
def path_soft_time_limit(self: Any) -> str:
    return body_long(self)


@app.task(**FENCED, time_limit=2)
def path_hard_time_limit(self: Any) -> str:
    return body_long(self)


@app.task(**FENCED)
def path_forget(self: Any) -> str:
    return body_success(self)


@app.task(**FENCED)
def path_member(self: Any, index: int) -> int:
    """A chord part or a group member."""
    with Exits(self):
        begin(self)
        step(self, "finish")
        return index


@app.task(**FENCED)
def path_count_parts(self: Any, results: list[int]) -> int:
    """The chord's callback: counts its parts."""
    with Exits(self):
        step(self, "finish")
        return len(results)


# -- plain twins: what plain Celery stores for the paths whose outcome depends on the pool ---------

PLAIN = {"bind": True}


@app.task(**PLAIN)
def plain_failure(self: Any) -> None:
    body_failure(self)


@app.task(**PLAIN)
def plain_ignore(self: Any) -> None:
    body_ignore(self)


@app.task(**PLAIN, ignore_result=True)
def plain_ignore_result(self: Any) -> str:
    return body_ignore_result(self)


@app.task(**PLAIN, acks_late=True)
def plain_reject(self: Any) -> None:
    body_reject(self)


@app.task(**PLAIN)
def plain_revoke_terminate(self: Any) -> str:
    return body_until_revoked(self)


@app.task(**PLAIN, soft_time_limit=1.5)
def plain_soft_time_limit(self: Any) -> str:
    return body_long(self)


@app.task(**PLAIN, time_limit=2)
def plain_hard_time_limit(self: Any) -> str:
    return body_long(self)
