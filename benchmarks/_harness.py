"""Shared process harness of the benchmarks: a private Redis, workers and beat."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

from celery_fenced.testing import default_binary

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Harness:
    """A private Redis plus Celery processes of one benchmark run; stops them all on exit."""

    def __init__(self, app_module: str, settings: dict | None = None) -> None:  # type: ignore[type-arg]
        self.app_module = app_module
        self.tmp = Path(tempfile.mkdtemp(prefix="fenced-bench-"))
        self.port = free_port()
        self.redis_proc = subprocess.Popen(
            [default_binary(), "--port", str(self.port), "--save", "", "--appendonly", "no", "--dir", str(self.tmp)],
            stdout=subprocess.DEVNULL,
        )
        self.client = redis.Redis(port=self.port)
        wait(lambda: _pings(self.client), 10, "redis")
        self.env = dict(
            os.environ,
            PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            FENCED_BENCH_REDIS=f"redis://127.0.0.1:{self.port}",
            FENCED_BENCH_SETTINGS=json.dumps(settings or {}),
        )
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("FENCED_BENCH")})
        self.procs: list[subprocess.Popen[bytes]] = []

    def celery(self, *argv: str, ready: str, name: str, app: str | None = None) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app or self.app_module, *argv],
            env=self.env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        wait(lambda: ready in log.read_text(errors="replace"), 60, f"{name} to start")
        return proc

    def worker(
        self, name: str, pool: str = "prefork", concurrency: int = 2, app: str | None = None
    ) -> subprocess.Popen[bytes]:
        argv = ["worker", "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", "-l", "INFO"]
        argv += ["--without-mingle", "--without-gossip"]
        return self.celery(*argv, ready=" ready.", name=name, app=app)

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        """Stop one process started here."""
        self.procs.remove(proc)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)

    def beat(self) -> subprocess.Popen[bytes]:
        return self.celery(
            "beat",
            "-s",
            str(self.tmp / "schedule"),
            "--max-interval",
            "1",
            "-l",
            "INFO",
            ready="beat: Starting",
            name="beat",
        )

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        self.redis_proc.terminate()
        self.redis_proc.wait(10)
        if not os.environ.get("FENCED_BENCH_KEEP"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)
