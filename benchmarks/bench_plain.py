"""The plain Celery app the benchmarks compare against (its own module: fenced tasks are shared
with every app of a process, and a worker refuses a fenced task without the fenced backend)."""

from __future__ import annotations

import json
import os
import time

from celery import Celery

from benchmarks._waits import wait_on_a_socket

REDIS = os.environ.get("FENCED_BENCH_REDIS", "redis://127.0.0.1:6379")

app = Celery("bench_plain", broker=f"{REDIS}/2", backend=f"{REDIS}/3")
app.conf.update(worker_prefetch_multiplier=1, worker_disable_prefetch=True, worker_hijack_root_logger=False)
#: Celery's own settings of the run apply to both sides (``task_track_started``, say).
_SHARED = ("task_track_started",)
app.conf.update({k: v for k, v in json.loads(os.environ.get("FENCED_BENCH_SETTINGS", "{}")).items() if k in _SHARED})


@app.task
def plain_short(seconds: float) -> dict[str, int]:
    """The same short task as the fenced one, plain Celery (the same small dict returned)."""
    time.sleep(seconds)
    return {"rows": 1}


@app.task
def plain_socket_wait(seconds: float) -> None:
    """The same socket wait as the fenced one, plain Celery."""
    wait_on_a_socket(seconds)
