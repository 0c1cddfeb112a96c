"""The fenced benchmark apps' one configuration (settings from FENCED_BENCH_* variables)."""

from __future__ import annotations

import json
import os

from celery import Celery

from celery_fenced import install

#: The private Redis of the run (``Harness``).
REDIS = os.environ.get("FENCED_BENCH_REDIS", "redis://127.0.0.1:6379")


def fenced_bench_app(name: str, broker_db: int, backend_db: int) -> Celery:
    """A fenced app on the run's Redis, its broker and results in databases of its own."""
    app = Celery(name, broker=f"{REDIS}/{broker_db}", backend=f"fenced+{REDIS}/{backend_db}")
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
    return app
