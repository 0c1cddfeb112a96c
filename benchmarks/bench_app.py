"""The Celery app the benchmarks run (settings from FENCED_BENCH_* environment variables)."""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from benchmarks._apps import REDIS, fenced_bench_app
from benchmarks._waits import wait_on_a_socket
from celery_fenced import ProgressLeasedTask

app = fenced_bench_app("bench_app", broker_db=0, backend_db=1)

_marks: redis.Redis | None = None


def marks() -> redis.Redis:
    global _marks
    if _marks is None or _marks.connection_pool.pid != os.getpid():
        _marks = redis.Redis.from_url(f"{REDIS}/4")
    return _marks


@app.task(bind=True, base=ProgressLeasedTask)
def stall_once(self: Any) -> str:
    """First attempt: progress in stage "work", then block; later attempts record their start."""
    key = f"attempts:{self.request.id}"
    attempt = marks().incr(key)
    self.progress("work")
    if attempt == 1:
        marks().set(f"stalled:{self.request.id}", time.time())
        time.sleep(6)  # blocked past the takeover, then the process is free again
        return "zombie"
    marks().set(f"taken:{self.request.id}", time.time())
    return "owner"


@app.task(bind=True, base=ProgressLeasedTask)
def fenced_short(self: Any, seconds: float) -> dict[str, int]:
    """A short fenced task: it reports one progress detail and returns a small dict."""
    time.sleep(seconds)
    self.progress("work", rows=1)
    return {"rows": 1}


@app.task(bind=True, base=ProgressLeasedTask)
def fenced_socket_wait(self: Any, seconds: float) -> None:
    """A fenced task that waits on a socket (the plain app's wait), then reports its progress."""
    wait_on_a_socket(seconds)
    self.progress("work")
