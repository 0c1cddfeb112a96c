"""What one worker process runs for one app (_worker/runtime.py): one runtime per app and
process, with the worker's write hook, its threads started and stopped together, and none in a
forked child until it makes its own. What a fork waits for is tested with the fork guard
(tests/unit/worker/test_fork_guard.py)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_fenced._celery.apps import record_of
from celery_fenced._worker.attempt import after_write
from celery_fenced._worker.process import WORKER_PROCESS
from celery_fenced._worker.runtime import (
    WorkerRuntime,
    reservation_writer_of,
    runtime_of,
    runtimes,
    stop_runtimes,
)
from tests.support.processes import in_a_forked_child, wait_until

#: The threads a runtime starts: the heartbeat, and in the worker's main process the others.
THREADS = {"celery-fenced-heartbeat", "celery-fenced-liveness", "celery-fenced-reaper", "celery-fenced-reservations"}


@pytest.fixture
def app() -> Iterator[Celery]:
    """An app no runtime was made for."""
    app = Celery("runtime", set_as_current=False)
    yield app
    runtime = runtime_of(app, create=False)
    if runtime is not None:
        runtime.stop()


def started_threads(before: set[threading.Thread]) -> dict[str, threading.Thread]:
    """The runtime's threads started since ``before``, by name."""
    return {thread.name: thread for thread in set(threading.enumerate()) - before if thread.name in THREADS}


def test_an_app_has_no_runtime_until_one_is_asked_for(app: Celery) -> None:
    assert runtime_of(app, create=False) is None
    assert record_of(app).write_hook is None
    assert reservation_writer_of(app) is None
    assert runtime_of(app, create=False) is None  # asking does not make one


def test_runtime_of_makes_one_runtime_per_app_and_process_and_installs_the_workers_write_hook(app: Celery) -> None:
    runtime = runtime_of(app)
    assert isinstance(runtime, WorkerRuntime)
    assert (runtime.app, runtime.pid) == (app, os.getpid())
    assert runtime_of(app) is runtime
    assert runtime_of(app, create=False) is runtime
    assert record_of(app).write_hook is after_write  # the worker hears its backend's writes
    assert runtime in runtimes()
    other = Celery("other", set_as_current=False)
    try:
        assert runtime_of(other) is not runtime
    finally:
        runtime_of(other).stop()  # type: ignore[union-attr]


def test_the_heartbeat_is_made_at_first_use_once(app: Celery) -> None:
    runtime = runtime_of(app)
    assert runtime is not None
    assert runtime.heartbeat(create=False) is None
    heartbeat = runtime.heartbeat()
    assert heartbeat is not None
    assert runtime.heartbeat() is heartbeat and runtime.heartbeat(create=False) is heartbeat


def test_the_main_process_threads_start_and_stop_with_the_runtime(fenced_app: Celery) -> None:
    runtime = runtime_of(fenced_app)
    assert runtime is not None
    before = set(threading.enumerate())
    try:
        runtime.start_main_process_threads("w1@host")
        heartbeat = runtime.heartbeat()
        assert heartbeat is not None
        heartbeat.start()
        assert reservation_writer_of(fenced_app) is runtime.reservations is not None
        assert runtime.liveness is not None and runtime.reaper is not None
        threads = started_threads(before)
        assert set(threads) == THREADS
    finally:
        runtime.stop(heartbeat=False)  # the worker's steps stop: its pool may still run bodies
    alive = sorted(name for name, thread in threads.items() if thread.is_alive())
    assert alive == ["celery-fenced-heartbeat", "celery-fenced-liveness"]
    workers = fenced_app.backend.lease_store.liveness.workers()
    assert [worker_id for worker_id, *_ in workers] == [runtime.liveness.worker_id]  # hand-offs filed under it
    runtime.stop()  # the worker stopped, its pool included
    assert not any(thread.is_alive() for thread in threads.values())
    assert fenced_app.backend.lease_store.liveness.workers() == []


def test_stop_runtimes_stops_every_runtime_of_the_process(app: Celery) -> None:
    runtime = runtime_of(app)
    assert runtime is not None
    before = set(threading.enumerate())
    heartbeat = runtime.heartbeat()
    assert heartbeat is not None
    heartbeat.start()
    (thread,) = started_threads(before).values()
    stop_runtimes(heartbeat=False)
    assert thread.is_alive()
    stop_runtimes()
    assert not thread.is_alive()


class WatchedLock:
    """A lock that counts the threads that asked for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.asked = 0
        self._count = threading.Lock()

    def __enter__(self) -> WatchedLock:
        with self._count:
            self.asked += 1
        self.lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_threads_asking_at_once_get_the_same_runtime(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    watched = WatchedLock()
    monkeypatch.setattr(WORKER_PROCESS, "runtimes_lock", watched)
    got: list[WorkerRuntime | None] = []
    threads = [threading.Thread(target=lambda: got.append(runtime_of(app))) for _ in range(4)]
    with watched.lock:  # every thread finds no runtime, then waits for the lock
        for thread in threads:
            thread.start()
        wait_until(lambda: watched.asked == 4, 10, "every thread to wait for the lock")
    for thread in threads:
        thread.join(timeout=10)
    assert len(got) == 4 and all(runtime is runtime_of(app) for runtime in got)


def test_a_forked_child_starts_with_no_runtime_and_makes_its_own(app: Celery) -> None:
    parent = runtime_of(app)
    assert parent is not None

    def in_the_child() -> dict[str, object]:
        seen: dict[str, object] = {"kept": record_of(app).runtime is not None}  # the fork handler forgot it
        seen["runtimes"] = len(runtimes())
        own = runtime_of(app)
        seen["own"] = own is not parent and own is not None and own.pid == os.getpid()
        return seen

    assert in_a_forked_child(in_the_child) == {"kept": False, "runtimes": 0, "own": True}
    assert runtime_of(app, create=False) is parent  # the parent keeps its own


def test_a_runtime_another_process_made_is_not_this_ones(app: Celery) -> None:
    parent = runtime_of(app)
    assert parent is not None

    def in_the_child() -> dict[str, object]:
        record_of(app).runtime = parent  # as if the fork handler had not run
        seen: dict[str, object] = {"runtime": runtime_of(app, create=False) is not None, "runtimes": len(runtimes())}
        own = runtime_of(app)
        seen["own"] = own is not parent and own is not None and own.pid == os.getpid()
        return seen

    assert in_a_forked_child(in_the_child) == {"runtime": False, "runtimes": 0, "own": True}
