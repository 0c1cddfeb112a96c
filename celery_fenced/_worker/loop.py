"""One daemon thread that runs a step every interval: the loop the package's threads share.

The heartbeat (:mod:`celery_fenced._worker.heartbeat`), the worker's reaper thread and its liveness
record (:mod:`celery_fenced._worker.reaper_thread`, :mod:`celery_fenced._worker.liveness`)
each run one. The thread waits on an ``Event``, so :meth:`TickLoop.wake` runs the next step
at once and :meth:`TickLoop.stop` ends the wait under way; a stopped loop is joined.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["TickLoop"]


class TickLoop:
    """A daemon thread: wait, step, wait the seconds the step answers, step, … until stopped.

    Args:
        name: the thread's name.
        step: one step, run in the thread; it answers the seconds to wait before the next
            one. It handles (and logs) its own errors: the loop has no other way to go on.
        first_wait: the seconds to wait before the first step (``None``: none, at once).
        at_exit: run in the thread once the loop stops (``None``: nothing).
    """

    def __init__(
        self,
        name: str,
        step: Callable[[], float],
        *,
        first_wait: Callable[[], float] | None = None,
        at_exit: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self._step = step
        self._first_wait = first_wait
        self._at_exit = at_exit
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        #: The thread of the last :meth:`start` (``None`` before the first).
        self.thread: threading.Thread | None = None

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called (until the next :meth:`start`)."""
        return self._stop.is_set()

    def start(self) -> None:
        """Start the thread (idempotent: a thread still alive goes on)."""
        with self._lock:
            if self.thread is not None and self.thread.is_alive():
                return
            self._stop.clear()
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()

    def wake(self) -> None:
        """Run the next step now, not at the end of the wait under way."""
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and join its thread (unless called from it)."""
        self._stop.set()
        self._wake.set()
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        wait = self._first_wait() if self._first_wait is not None else None
        stop, wake = self._stop, self._wake
        try:
            while True:
                if wait is not None:
                    wake.wait(wait)
                    wake.clear()
                if stop.is_set():
                    return
                wait = self._step()
        finally:
            if self._at_exit is not None:
                self._at_exit()
