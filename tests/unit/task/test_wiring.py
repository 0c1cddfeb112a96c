"""How a fenced task wires an app to the worker side (_task/wiring.py): the receivers and the
bootsteps are named, not imported, and connected once per app. That a process that only sends
tasks loads none of the worker side is tested in its own process
(tests/unit/test_process_state.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery
from kombu.utils.imports import symbol_by_name

from celery_fenced import ProgressLeasedTask
from celery_fenced._reaper.reaper import REAP_TASK_NAME
from celery_fenced._task import wiring
from celery_fenced._worker import hooks, interrupt, lifecycle
from celery_fenced._worker.request import FencedRequest


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("wired", set_as_current=False)
    yield app
    app.close()


def named_steps(app: Celery) -> list[str]:
    """The worker's and the consumer's bootsteps that ``app`` names (as Celery loads them)."""
    return sorted(step for step in app.steps["worker"] | app.steps["consumer"] if isinstance(step, str))


def test_binding_a_fenced_task_wires_the_worker_by_name(fenced_app: Celery) -> None:
    @fenced_app.task(base=ProgressLeasedTask, shared=False)
    def report() -> None: ...

    fenced_app.finalize()  # binds the task: its on_bound wires the app
    assert {symbol_by_name(step) for step in named_steps(fenced_app)} == {
        hooks.FencedWorkerStep,
        hooks.ChildExitWatch,
        hooks.ReconnectWatch,
        hooks.HoldBackBehindStalledOwners,
    }
    assert REAP_TASK_NAME in fenced_app.tasks


def test_wiring_an_app_again_changes_nothing_and_it_reads_the_fenced_defaults(app: Celery) -> None:
    wiring.connect_worker_hooks(app)
    steps = named_steps(app)
    wiring.connect_worker_hooks(app)
    assert named_steps(app) == steps and len(steps) == 4
    assert app.conf.fenced_lease_ttl > 0  # the documented defaults, readable from app.conf


def test_the_names_celery_loads_are_the_worker_sides_classes() -> None:
    assert symbol_by_name(wiring.WORKER_REQUEST) is FencedRequest
    assert ProgressLeasedTask.Request == wiring.WORKER_REQUEST  # loaded by name in a worker
    assert symbol_by_name(f"{wiring.WORKER_HOOKS}:FencedWorkerStep") is hooks.FencedWorkerStep


def test_the_door_opens_on_the_worker_sides_modules() -> None:
    assert wiring.worker_lifecycle() is lifecycle
    assert wiring.worker_lifecycle() is lifecycle  # loaded once, then kept
    assert wiring.worker_interrupt() is interrupt
