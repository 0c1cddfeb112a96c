"""The fenced app of the floor (``benchmarks/floor``): the benchmark app's settings and task,
its own Redis databases, and a worker that runs the floor's acquire and store scripts.

Its own module for the same reason as ``bench_plain``: each side's worker imports only its
app. The floor's scripts are put in place when a worker starts (``worker_init``), so a client
process that imports this module for the task keeps the package's scripts.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery, signals

from benchmarks.floor import use_floor_scripts
from celery_fenced import ProgressLeasedTask, install

REDIS = os.environ.get("FENCED_BENCH_REDIS", "redis://127.0.0.1:6379")

app = Celery("bench_floor", broker=f"{REDIS}/5", backend=f"fenced+{REDIS}/6")
app.conf.update(
    worker_prefetch_multiplier=1,
    worker_disable_prefetch=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    fenced_lease_ttl=3,
    fenced_heartbeat_interval=0.5,
    fenced_stage_timeouts={"work": 1.0},
    fenced_reaper_interval=1,
)
app.conf.update(json.loads(os.environ.get("FENCED_BENCH_SETTINGS", "{}")))
install(app)


@signals.worker_init.connect(weak=False)
def _floor_scripts_in_the_worker(**_: Any) -> None:
    use_floor_scripts()


@app.task(bind=True, base=ProgressLeasedTask)
def floor_short(self: Any, seconds: float) -> dict[str, int]:
    """The benchmark's short fenced task (one progress detail, a small dict), on the floor."""
    time.sleep(seconds)
    self.progress("work", rows=1)
    return {"rows": 1}
