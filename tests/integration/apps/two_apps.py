"""One module, two apps: a fenced one and a plain one (``@app.task`` shares tasks between them)."""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from celery_fenced import ProgressLeasedTask

BROKER = os.environ.get("FENCED_TEST_BROKER_URL", "redis://127.0.0.1:6379/0")
FENCED_BACKEND = os.environ.get("FENCED_TEST_BACKEND_URL", "fenced+redis://127.0.0.1:6379/1")

fenced_app = Celery("fenced_side", broker=BROKER, backend=FENCED_BACKEND)
plain_app = Celery("plain_side", broker=BROKER, backend=FENCED_BACKEND.removeprefix("fenced+"))
for each in (fenced_app, plain_app):
    each.conf.update(broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)


@fenced_app.task(bind=True, base=ProgressLeasedTask)
def leased(self: Any, x: int) -> int:
    """The fenced app's task."""
    self.progress("load-data")
    return x + 1


@plain_app.task
def doubled(x: int) -> int:
    """The plain app's task."""
    return 2 * x
