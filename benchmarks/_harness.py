"""Shared process harness of the benchmarks: a private Redis, workers and beat."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

from celery_fenced.harness import RedisServer, default_binary, wait_until

ROOT = Path(__file__).resolve().parent.parent


class Harness:
    """A private Redis plus Celery processes of one benchmark run; stops them all on exit."""

    def __init__(self, app_module: str, settings: dict | None = None) -> None:  # type: ignore[type-arg]
        self.app_module = app_module
        self.tmp = Path(tempfile.mkdtemp(prefix="fenced-bench-"))
        self.redis = RedisServer(default_binary(), self.tmp / "redis").start(timeout=10)
        self.port = self.redis.port
        self.client = redis.Redis(port=self.port)
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
        wait_until(lambda: ready in log.read_text(errors="replace"), 60, f"{name} to start")
        return proc

    def worker(
        self, name: str, pool: str = "prefork", concurrency: int = 2, app: str | None = None, events: bool = False
    ) -> subprocess.Popen[bytes]:
        """Start a worker; ``events`` turns task events on (``-E``), as Flower users run it."""
        argv = ["worker", "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", "-l", "INFO"]
        argv += ["--without-mingle", "--without-gossip", *(["-E"] if events else [])]
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
        # Results left in reference cycles are collected while Redis still answers: Celery
        # 5.5's AsyncResult.__del__ unsubscribes, and retries for ever once Redis is gone.
        gc.collect()
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
        self.redis.stop()
        if not os.environ.get("FENCED_BENCH_KEEP"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
