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

A pass builds what it uses (the lease store, the broker's producer pool: cached properties,
whose locks a fork must not copy while they are held) under
:data:`~celery_fenced._worker.fork_guard.FORK_GUARD`, and makes its Redis and broker round
trips outside it: a slow broker or a Redis outage never holds up the pool's forks, and so
never a new process that would free a slot.
"""

from __future__ import annotations

import logging
import random

from celery import Celery

from .._lease.store import lease_store_of
from .._reaper.reaper import failure_text, reap
from ..conf import ensure_conf
from .fork_guard import FORK_GUARD
from .loop import TickLoop

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
        self._failing: str | None = None  # the error last logged, so an outage logs once
        # A random first wait: workers started together do not all reap at the same instant.
        self._loop = TickLoop("celery-fenced-reaper", self._step, first_wait=lambda: random.uniform(0, self.interval))

    def start(self) -> None:
        """Start the thread (idempotent)."""
        self._loop.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and join it."""
        self._loop.stop(timeout)

    def _step(self) -> float:
        self.run_once()
        return self.interval

    def wake(self) -> None:
        """Run a pass now, not at the end of the wait under way."""
        self._loop.wake()

    def run_once(self) -> None:
        """One pass; an error is logged once while it lasts, and the thread goes on."""
        self.passes += 1
        try:
            with FORK_GUARD:
                self._build()
            reap(self.app)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if text != self._failing:
                logger.warning(
                    "reaper pass failed (%s); retrying every %gs", failure_text(self.app, exc), self.interval
                )
                self._failing = text
            return
        if self._failing is not None:
            logger.warning("reaper passes work again")
            self._failing = None

    def _build(self) -> None:
        """What the pass uses and builds on first use (cached properties): built under the guard."""
        app = self.app
        lease_store_of(app, "the worker's reaper")
        app.amqp  # noqa: B018 (built on first use)
        app.producer_pool  # noqa: B018 (built on first use)
