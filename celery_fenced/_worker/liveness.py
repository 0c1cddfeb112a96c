"""The liveness record of a worker's main process: how the reaper tells a dead worker's
reservations from a live worker's backlog.

A worker's main process receives messages before any process starts them, and records a
reservation for each (:mod:`~celery_fenced._worker.reservations`). A killed worker takes those
messages with it, and kombu's Redis transport gives them back only after its visibility
timeout (an hour). A reservation alone cannot tell a dead worker from a live one with a long
backlog, so it is sent again only after ``fenced_start_timeout``.

:class:`LivenessRecord` renews the worker's record every ``fenced_heartbeat_interval`` seconds,
holding for ``fenced_lease_ttl`` (``worker_alive.lua``), in a daemon thread of the main
process that no task can block. When the record lapses, the next reaper pass makes that
worker's reservations due (``lapse_worker.lua``) and sends them again at once: a dead worker's
tasks come back within the lease TTL and a reaper interval, and a live worker's backlog waits
as before. A warm shutdown removes the record (``worker_left.lua``): the broker takes back
what the worker did not start.
"""

from __future__ import annotations

import contextlib
import logging

from celery import Celery

from .._lease.store import LeaseStore, lease_store_of
from ..conf import ensure_conf
from .fork_guard import FORK_GUARD
from .loop import TickLoop

__all__ = ["LivenessRecord"]

logger = logging.getLogger("celery_fenced.worker.liveness")


class LivenessRecord:
    """Renews a worker's liveness record from a daemon thread of its main process.

    Args:
        app: the worker's app (its result backend is the fenced one).
        worker_id: this start of the worker (:func:`~celery_fenced._lease.liveness_store.worker_id_of`), as its
            reservations are recorded under it.
    """

    def __init__(self, app: Celery, worker_id: str) -> None:
        self.app = app
        self.worker_id = worker_id
        policy = ensure_conf(app).policy
        self.interval = policy.heartbeat_interval
        self.ttl_ms = policy.lease_ttl_ms
        self.renewals = 0
        self._failing: str | None = None
        self._loop = TickLoop(
            "celery-fenced-liveness", self._step, first_wait=lambda: self.interval, at_exit=self._disconnect
        )

    def start(self) -> None:
        """Write the record now, then renew it in a thread (idempotent)."""
        thread = self._loop.thread
        if thread is not None and thread.is_alive():
            return
        self.renew()
        self._loop.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop renewing, join the thread and remove the record (a warm shutdown)."""
        self._loop.stop(timeout)
        try:
            self._store().liveness.worker_left(self.worker_id)
        except Exception as exc:
            logger.warning("could not remove the liveness record of %s (%r): it lapses by itself", self.worker_id, exc)

    def renew(self) -> None:
        """Renew the record once; an error is logged once while it lasts."""
        try:
            self._store().liveness.worker_alive(self.worker_id, self.ttl_ms)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if text != self._failing:
                logger.warning("could not renew this worker's liveness record (%s); retrying", text)
                self._failing = text
            return
        self.renewals += 1
        if self._failing is not None:
            logger.warning("this worker's liveness record is renewed again")
            self._failing = None

    def _step(self) -> float:
        self.renew()
        return self.interval

    def _disconnect(self) -> None:
        # The backend of this thread (Celery keeps one per thread) is not used again.
        with contextlib.suppress(Exception):
            self._store().client.connection_pool.disconnect()

    def _store(self) -> LeaseStore:
        with FORK_GUARD:  # the backend and its store are cached_properties, built on first use
            return lease_store_of(self.app, "the liveness record")
