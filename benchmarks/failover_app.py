"""The apps of the failover benchmark: one plain, one fenced, both on Sentinel.

``FENCED_BENCH_SENTINELS`` names the Sentinels (``host:port,…``) and ``FENCED_BENCH_FENCED``
whether the worker runs the fenced backend (``1``) or Celery's own Sentinel backend.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_fenced import ProgressLeasedTask, install

SENTINELS = [address for address in os.environ.get("FENCED_BENCH_SENTINELS", "").split(",") if address]
FENCED = os.environ.get("FENCED_BENCH_FENCED") == "1"
OPTIONS = {"master_name": "mymaster"}


def _url(scheme: str, db: int) -> str:
    return scheme + ";".join(f"sentinel://{address}/{db}" for address in SENTINELS)


app = Celery("failover_app", broker=_url("", 0), backend=_url("fenced+" if FENCED else "", 1))
app.conf.update(
    broker_transport_options=OPTIONS,
    result_backend_transport_options=OPTIONS,
    worker_prefetch_multiplier=1,
    worker_disable_prefetch=True,
    worker_hijack_root_logger=False,
    fenced_lease_ttl=3,
    fenced_heartbeat_interval=0.5,
    fenced_reaper_interval=1,
)
if FENCED:
    install(app)


@app.task(bind=True, base=ProgressLeasedTask if FENCED else app.Task)
def add(self: object, x: int, y: int) -> int:
    """A short task: fenced on the fenced worker, plain on the plain one."""
    return x + y
