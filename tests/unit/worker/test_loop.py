"""The loop the package's threads share: a step every interval, woken at once, stopped and joined."""

from __future__ import annotations

import threading

import pytest

from celery_fenced._worker.loop import TickLoop
from celery_fenced.harness import wait_until


class Steps:
    """A step that records the thread it ran in and answers ``wait``."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self.threads: list[str] = []

    def __call__(self) -> float:
        self.threads.append(threading.current_thread().name)
        return self.wait


def test_it_steps_at_once_then_after_each_wait_the_step_answers() -> None:
    steps = Steps(0.01)
    loop = TickLoop("test-loop", steps)
    loop.start()
    try:
        wait_until(lambda: len(steps.threads) >= 3, 5, "three steps")
    finally:
        loop.stop()
    assert set(steps.threads) == {"test-loop"}
    assert loop.thread is not None and not loop.thread.is_alive()


def test_the_first_step_waits_for_its_first_wait_unless_woken() -> None:
    steps = Steps(3600.0)
    loop = TickLoop("test-loop", steps, first_wait=lambda: 3600.0)
    loop.start()
    try:
        with pytest.raises(AssertionError):
            wait_until(lambda: steps.threads, 0.2, "a step before the first wait")
        loop.wake()
        wait_until(lambda: steps.threads, 5, "the step the wake asked for")
        assert len(steps.threads) == 1
    finally:
        loop.stop()


def test_stop_ends_the_wait_under_way_runs_at_exit_and_joins() -> None:
    exited: list[str] = []
    loop = TickLoop("test-loop", Steps(3600.0), at_exit=lambda: exited.append(threading.current_thread().name))
    loop.start()
    thread = loop.thread
    assert thread is not None and thread.is_alive()
    loop.start()
    assert loop.thread is thread  # idempotent while it runs
    loop.stop(timeout=5)
    assert not thread.is_alive() and exited == ["test-loop"] and loop.stopping
    loop.start()  # and again after a stop
    assert loop.thread is not thread and not loop.stopping
    loop.stop(timeout=5)
    assert exited == ["test-loop", "test-loop"]
