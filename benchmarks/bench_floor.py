"""The fenced app of the floor (``benchmarks/floor``): the benchmark app's settings and task,
its own Redis databases, and a worker that runs the floor's acquire and store scripts.

Its own module for the same reason as ``bench_plain``: each side's worker imports only its
app. The floor's scripts are put in place when a worker starts (``worker_init``), so a client
process that imports this module for the task keeps the package's scripts.
"""

from __future__ import annotations

import time
from typing import Any

from celery import signals

from benchmarks._apps import fenced_bench_app
from benchmarks.floor import use_floor_scripts
from celery_fenced import ProgressLeasedTask

app = fenced_bench_app("bench_floor", broker_db=5, backend_db=6)


@signals.worker_init.connect(weak=False)
def _floor_scripts_in_the_worker(**_: Any) -> None:
    use_floor_scripts()


@app.task(bind=True, base=ProgressLeasedTask)
def floor_short(self: Any, seconds: float) -> dict[str, int]:
    """The benchmark's short fenced task (one progress detail, a small dict), on the floor."""
    time.sleep(seconds)
    self.progress("work", rows=1)
    return {"rows": 1}
