"""Fixtures that run the real thing: worker and beat processes against a private Redis."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_fenced._celery.compat import GEVENT_POOL_CANNOT_DISABLE_PREFETCH
from celery_fenced._lease.finished import fence_of
from celery_fenced._lease.keys import KeySpace
from tests.support.processes import CeleryProcess, wait_until
from tests.support.redis_server import RedisServer, default_binary

APP = "tests.integration.apps.fenced_app"
ROOT = Path(__file__).resolve().parents[2]

BROKER_DB, BACKEND_DB, RECORD_DB = 0, 1, 2


def rabbitmq_url() -> str | None:
    """The RabbitMQ broker URL, when the tests are asked to use one and it is reachable."""
    if os.environ.get("FENCED_TEST_BROKER", "redis") != "rabbitmq":
        return None
    url = os.environ.get("FENCED_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")
    host_port = url.split("@", 1)[-1].split("/", 1)[0]
    host, _, port = host_port.partition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port or 5672)), timeout=1).close()
    except OSError:
        return None
    return url


KEYS = KeySpace.build("fenced", "celery-task-meta-")


def _close_what_celerys_pubsub_reconnect_drops() -> None:
    """Close the sockets Celery's result consumer drops when its Redis connection is lost.

    ``ResultConsumer._reconnect_pubsub`` (Celery 5.5 to 5.7) forgets its pubsub and resets the
    client's pool without closing either: their sockets are left to the collector, whose
    ``ResourceWarning`` would fail whichever later test it runs in. The tests that restart
    Redis would otherwise make that warning; this closes them first, so the check against
    this package's own leaks stays on.
    """
    from celery.backends.redis import ResultConsumer

    reconnect = ResultConsumer._reconnect_pubsub
    if getattr(reconnect, "closes_dropped_sockets", False):
        return

    def reconnect_closing_the_old_sockets(self: Any) -> None:
        if self._pubsub is not None:
            self._pubsub.close()
        self.backend.client.connection_pool.disconnect()
        reconnect(self)

    reconnect_closing_the_old_sockets.closes_dropped_sockets = True  # type: ignore[attr-defined]
    ResultConsumer._reconnect_pubsub = reconnect_closing_the_old_sockets  # type: ignore[method-assign]


_close_what_celerys_pubsub_reconnect_drops()


def stored(cluster: Cluster, task_id: str) -> dict[str, Any] | None:
    """The result meta stored for ``task_id`` (decoded), or ``None``."""
    raw = cluster.results.get(KEYS.result(task_id))
    return json.loads(raw) if raw else None


def lease(cluster: Cluster, task_id: str) -> dict[str, str]:
    """The raw fields of ``task_id``'s lease hash; for a task finished by an owner's READY
    result, which leaves no hash, the DONE lease its result carries (as ``inspect`` reads it)."""
    fields = {k.decode(): v.decode() for k, v in cluster.results.hgetall(KEYS.lease(task_id)).items()}
    if fields:
        return fields
    fence = fence_of(cluster.results.get(KEYS.result(task_id)))
    return fence.lease_fields() if fence is not None else {}


class Cluster:
    """Workers, beat and clients of one test, all on one Redis server."""

    def __init__(self, server: RedisServer, tmp_path: Path) -> None:
        self.server = server
        self.tmp_path = tmp_path
        self.processes: list[CeleryProcess] = []
        self.broker_url = rabbitmq_url() or server.url(BROKER_DB)
        self.backend_url = "fenced+" + server.url(BACKEND_DB)
        self.record_url = server.url(RECORD_DB)
        self.settings: dict[str, Any] = {}
        self.record = redis.Redis.from_url(self.record_url, decode_responses=True)
        self.results = redis.Redis.from_url(server.url(BACKEND_DB))

    def env(self, **settings: Any) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            FENCED_TEST_BROKER_URL=self.broker_url,
            FENCED_TEST_BACKEND_URL=self.backend_url,
            FENCED_TEST_RECORD_URL=self.record_url,
            FENCED_TEST_SETTINGS=json.dumps({**self.settings, **settings}),
            PYTHONPATH=str(ROOT),
        )
        return env

    def app(self) -> Any:
        """The test app, configured for this cluster, in the test process."""
        os.environ.update({k: v for k, v in self.env().items() if k.startswith("FENCED_TEST_")})
        from tests.integration.apps import fenced_app

        fenced_app.app.conf.update(
            broker_url=self.broker_url,
            result_backend=self.backend_url,
            **self.settings,
        )
        from celery_fenced.conf import reset_conf

        app = fenced_app.app
        reset_conf(app)
        # Each test may run on another Redis: forget the connections made for the last one.
        app._pool = None
        app.amqp._producer_pool = None
        app._local.__dict__.pop("backend", None)
        return fenced_app

    def worker(
        self,
        name: str,
        pool: str = "prefork",
        concurrency: int = 2,
        queues: str | None = None,
        environ: dict[str, str] | None = None,
        **settings: Any,
    ) -> CeleryProcess:
        """Start a worker process (on ``queues``, comma-separated, if given) and wait until it is ready.

        ``environ`` overrides variables of its environment; ``settings`` are app settings.
        """
        argv = [
            "-A",
            APP,
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            f"{name}@{socket.gethostname()}",
            "-l",
            "INFO",
            "--without-mingle",
            "--without-gossip",
            "-E",
            *(["-Q", queues] if queues else []),
        ]
        if pool == "gevent" and GEVENT_POOL_CANNOT_DISABLE_PREFETCH:
            # Celery 5.6's gevent pool takes no message with prefetch disabled (the worker says
            # so and stops): late acks, as on Celery 5.5, keep a stuck greenlet's slot counted.
            settings = {"worker_disable_prefetch": False, "task_acks_late": True, **settings}
        env = {**self.env(**settings), **(environ or {})}
        proc = CeleryProcess(name, argv, env, self.tmp_path / f"{name}.log", " ready.")
        self.processes.append(proc)
        return proc.wait_ready()

    def beat(self, loglevel: str = "INFO", **settings: Any) -> CeleryProcess:
        """Start beat (the reaper's schedule) and wait until it runs."""
        argv = [
            "-A",
            APP,
            "beat",
            "-l",
            loglevel,
            "-s",
            str(self.tmp_path / "beat-schedule"),
            "--max-interval",
            "1",
        ]
        proc = CeleryProcess("beat", argv, self.env(**settings), self.tmp_path / "beat.log", "beat: Starting")
        self.processes.append(proc)
        return proc.wait_ready()

    def command(self, name: str, argv: list[str], ready: str, **env: str) -> CeleryProcess:
        """Start another ``celery -A <app> …`` command (Flower, the metrics exporter)."""
        proc = CeleryProcess(name, ["-A", APP, *argv], {**self.env(), **env}, self.tmp_path / f"{name}.log", ready)
        self.processes.append(proc)
        return proc.wait_ready()

    def cli(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run ``celery -A <app> fenced …`` to completion."""
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", APP, "fenced", *argv],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )

    def runs(self, task_id: str) -> list[dict[str, Any]]:
        """What each body execution of ``task_id`` recorded."""
        return [json.loads(x) for x in self.record.lrange(f"runs:{task_id}", 0, -1)]

    def wait_runs(self, task_id: str, count: int, timeout: float = 20) -> list[dict[str, Any]]:
        wait_until(lambda: len(self.runs(task_id)) >= count, timeout, f"{count} run(s) of {task_id}")
        return self.runs(task_id)

    def wake(self, task_id: str) -> None:
        """Let a zombie body return."""
        self.record.set(f"wake:{task_id}", 1)

    def logs(self) -> str:
        return "\n".join(f"===== {p.name} =====\n{p.log()}" for p in self.processes)

    def stop(self) -> None:
        for proc in self.processes:
            proc.stop()
        self.record.close()
        self.results.close()
        self._close_result_consumer()

    @staticmethod
    def _close_result_consumer() -> None:
        """Close this test's result subscriptions, so no later test's GC reopens and leaks them.

        An ``AsyncResult`` unsubscribes when it is collected (``__del__``); collected in a later
        test, after ``app()`` dropped this backend, it would open a connection nobody closes.
        """
        from tests.integration.apps import fenced_app

        backend = fenced_app.app._local.__dict__.get("backend")
        if backend is not None:
            # Results collected from now on unsubscribe nothing: Celery would connect a new
            # pubsub to do so, and leave its socket to the collector.
            backend.result_consumer.cancel_for = lambda task_id: None
        with warnings.catch_warnings():
            # A result collected here may belong to a backend this test no longer holds:
            # Celery's AsyncResult.__del__ then unsubscribes through a pubsub connection it
            # makes for that, and leaves its socket to the collector (seen with redis-py 6).
            # Not a socket of this package's: its own are checked everywhere else.
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        if backend is not None:
            backend.result_consumer.stop()
            backend.client.close()
            if "lease_store" in backend.__dict__:  # made only once a script ran in this process
                backend.lease_store.close()


def zombie_scenario(cluster: Cluster, environ: dict[str, str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """A stalled owner on w1, its takeover by w2, then the zombie's late SUCCESS refused.

    ``environ`` is given to both workers. Returns the task id and its runs (two).
    """
    app = cluster.app()
    w1 = cluster.worker("w1", concurrency=1, environ=environ)
    result = app.zombie_once.delay("x")
    cluster.wait_runs(result.id, 1)
    cluster.worker("w2", concurrency=1, environ=environ)
    runs = cluster.wait_runs(result.id, 2, timeout=20)
    assert result.get(timeout=20) == f"owner {runs[1]['token']} x"
    cluster.wake(result.id)
    wait_until(lambda: "stale write dropped" in w1.log(), 15, "the zombie's write to be refused")
    return result.id, runs


def _flushall(server: RedisServer) -> None:
    with server.client() as client:
        client.flushall()


def _run_cluster(server: RedisServer, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    _flushall(server)
    cluster = Cluster(server, tmp_path)
    yield cluster
    cluster.stop()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(cluster.logs()[-20000:])
    if server.running():
        _flushall(server)


@pytest.fixture
def cluster(redis_server: RedisServer, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Workers and beat of one test on the session's private Redis (flushed before and after)."""
    yield from _run_cluster(redis_server, tmp_path, request)


@pytest.fixture
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis server of this test alone, with AOF on: the test may stop and restart it."""
    server = RedisServer(default_binary(), tmp_path_factory.mktemp("own-redis"), appendonly=True).start()
    yield server
    if server.running():
        server.stop()


@pytest.fixture
def own_cluster(own_redis: RedisServer, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Workers and beat on a Redis this test owns (and may restart)."""
    yield from _run_cluster(own_redis, tmp_path, request)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
