"""Whether the body of an attempt may be interrupted now: :class:`Interrupter`.

An attempt whose lease is lost may have its body stopped
(:mod:`celery_fenced._worker.interrupt` delivers it). Three parties meet here: the heartbeat's
thread sends the interrupt, the body's thread ends the body or enters and leaves a shield,
and the delivery itself lands later (a gevent hub's callback, a signal handler). Each change
of the interrupt's state is a method of :class:`Interrupter` taken under its own lock, apart
from the lease's other state; the lock is never held while the body runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Interrupter"]


class Interrupter:
    """The interrupt's state of one attempt, and the thread (or greenlet) it would stop.

    Attributes:
        thread_id: the thread running the body.
        runner: the greenlet running the body on the gevent pool, else ``None``.
        body_done: the body returned or raised: nothing is interrupted any more.
        shield_depth: shielded blocks the body is in (an interrupt waits for the outermost's end).
        pending: an interrupt is held until the shield ends.
        sent: an asynchronous interrupt was sent and has not landed (it may be withdrawn).
        lock: taken by every change of the four above (but :meth:`signal_landed`'s).
    """

    __slots__ = ("body_done", "lock", "pending", "runner", "sent", "shield_depth", "thread_id")

    def __init__(self, thread_id: int, runner: Any = None) -> None:
        self.thread_id = thread_id
        self.runner = runner
        self.body_done = False
        self.shield_depth = 0
        self.pending = False
        self.sent = False
        self.lock = threading.Lock()

    def interrupt(self, deliver: Callable[[], bool]) -> str:
        """Interrupt the body: ``"done"`` when it finished, ``"held"`` while a shield runs
        (delivered at its end), else ``deliver()`` runs under the lock: ``"sent"``.

        ``deliver`` returns True for an asynchronous exception that the thread raises later:
        :meth:`finish_body` and :meth:`enter_shield` withdraw it if it has not landed.
        """
        with self.lock:
            if self.body_done:
                return "done"
            if self.shield_depth:
                self.pending = True
                return "held"
            self.sent = deliver()
            return "sent"

    def finish_body(self, withdraw: Callable[[Interrupter], None]) -> None:
        """The body returned or raised: no interrupt lands from now on."""
        with self.lock:
            self.body_done = True
            if self.sent:
                self.sent = False
                withdraw(self)

    def enter_shield(self, withdraw: Callable[[Interrupter], None]) -> None:
        """A shielded block begins: an interrupt sent and not landed waits for its end."""
        with self.lock:
            self.shield_depth += 1
            if self.sent:
                self.sent = False
                self.pending = True
                withdraw(self)

    def leave_shield(self) -> bool:
        """A shielded block ends; True when an interrupt held off is due now."""
        with self.lock:
            self.shield_depth -= 1
            due = self.shield_depth == 0 and self.pending and not self.body_done
            if due:
                self.pending = False
            return due

    def landing(self) -> bool | None:
        """An asynchronous interrupt is about to be raised in the body's greenlet (by the gevent
        hub, the greenlet parked): True to raise it, False when it was withdrawn meanwhile,
        ``None`` while the lock is held (the hub cannot wait for it: try again)."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            sent, self.sent = self.sent, False
            return sent
        finally:
            self.lock.release()

    def signal_landed(self) -> bool:
        """The interrupt's signal handler runs (in the body's thread, which may hold the lock,
        so it is not taken): True to raise it now, False when the body finished or is shielded
        (then it waits for the shield's end)."""
        if self.body_done:
            return False
        if self.shield_depth:
            self.pending = True
            return False
        return True
