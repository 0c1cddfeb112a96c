"""The reaper of a worker's main process: takeovers that need no free slot in the pool.

``celery_fenced.reap`` is an ordinary task: it runs in the pool it rescues. When every
process of every worker is held by a stalled owner (a downstream outage), neither the beat
message nor the re-sent tasks can run, and nothing is ever taken over. So each worker's
main process also runs one reaper pass every ``fenced_reaper_interval`` seconds in a daemon
thread of its own, where stuck task processes cannot block it:

* in the prefork pool, the main process runs no task at all;
* in the threads pool, the pass runs beside the task threads (a body blocked in a call
  releases the GIL);
* in the solo pool, the body runs in the main thread, and this thread beside it.

Several workers, and beat's message too, may reap at once: each lease is claimed by one
atomic script, so only one of them re-sends a task. A re-sent task still needs a process:
a lost lease frees its slot when the body is interrupted (``fenced_interrupt_on_loss``).

A pass holds :data:`~celery_fenced.worker.fork_guard.FORK_GUARD` throughout, so a fork of the
prefork pool waits for it to end.
"""

from __future__ import annotations

import logging
import random
import threading

from celery import Celery

from ..conf import ensure_conf
from ..reaper import reap
from .fork_guard import FORK_GUARD

__all__ = ["ReaperThread"]

logger = logging.getLogger("celery_fenced.reaper")


class ReaperThread:
    """A daemon thread running :func:`~celery_fenced.reap` every ``fenced_reaper_interval`` seconds.

    Args:
        app: the worker's app (its result backend is the fenced one).
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.interval = ensure_conf(app).reaper_interval
        self.passes = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: str | None = None  # the error last logged, so an outage logs once

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="celery-fenced-reaper", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and join it."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        # A random first wait: workers started together do not all reap at the same instant.
        wait = random.uniform(0, self.interval)
        while not self._stop.is_set():
            self._wake.wait(wait)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.run_once()
            wait = self.interval

    def wake(self) -> None:
        """Run a pass now, not at the end of the wait under way."""
        self._wake.set()

    def run_once(self) -> None:
        """One pass; an error is logged once while it lasts, and the thread goes on."""
        self.passes += 1
        try:
            with FORK_GUARD:
                reap(self.app)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if text != self._failing:
                logger.warning("reaper pass failed (%s); retrying every %gs", text, self.interval)
                self._failing = text
            return
        if self._failing is not None:
            logger.warning("reaper passes work again")
            self._failing = None
