"""Exceptions raised by celery-fenced.

The tree::

    FencedError
    ├── ConfigurationError          (also celery.exceptions.ImproperlyConfigured)
    ├── LeaseLostError              the owner no longer holds the lease: stop now
    │   └── StaleOwnerError         a write carried a token older than the current one
    ├── TaskAbandonedError          stored as the FAILURE of a task taken over too often
    ├── LeaseUnavailableError       stored as the FAILURE of a task whose lease could not be
    │                               taken, delivery after delivery
    └── LeaseScriptError            a lease script answered something this version does not know

    BaseException
    └── LeaseInterrupted            raised into a body whose lease was lost (an interrupt)

``LeaseLostError`` is what a task body sees from ``self.progress()`` once the lease is gone;
``StaleOwnerError`` is what the fenced write helpers raise for a writer whose token is old.
``LeaseInterrupted`` is not an ``Exception``: a body's ``except Exception`` around a blocking
call cannot swallow the interrupt that exists to free its process (as ``asyncio.CancelledError``).
"""

from __future__ import annotations

from celery.exceptions import ImproperlyConfigured

__all__ = [
    "ConfigurationError",
    "FencedError",
    "LeaseInterrupted",
    "LeaseLostError",
    "LeaseScriptError",
    "LeaseUnavailableError",
    "StaleOwnerError",
    "TaskAbandonedError",
]


class FencedError(Exception):
    """Base class of every exception this package raises."""


class ConfigurationError(FencedError, ImproperlyConfigured):
    """A ``fenced_*`` setting or a per-task option has a value that cannot work.

    The message names the setting and the value.
    """


class _AboutALostLease(BaseException):
    """What both a lost lease's error and its interrupt carry: the task, the token, why."""

    def __init__(self, task_id: str | None = None, token: int | None = None, reason: str = "") -> None:
        # args keep the constructor's arguments, so pickling and Celery's JSON
        # exception round trip both rebuild the same exception.
        super().__init__(task_id, token, reason)
        self.task_id = task_id
        self.token = token
        self.reason = reason


class LeaseLostError(_AboutALostLease, FencedError):
    """The lease of the running attempt is gone: taken over, fenced, cancelled or stalled.

    Attributes:
        task_id: the task whose lease was lost.
        token: the fencing token the lost owner held.
        reason: a short word saying why (``"taken-over"``, ``"stalled"``, ``"expired"`` …).
    """

    def __str__(self) -> str:
        return f"lease of task {self.task_id} (token {self.token}) lost: {self.reason}"


class StaleOwnerError(LeaseLostError):
    """A write was refused because a newer fencing token has written since.

    Attributes:
        current_token: the newer token that is stored, when known.
    """

    def __init__(
        self,
        task_id: str | None = None,
        token: int | None = None,
        reason: str = "stale token",
        current_token: int | None = None,
    ) -> None:
        super().__init__(task_id, token, reason)
        self.args = (task_id, token, reason, current_token)
        self.current_token = current_token

    def __str__(self) -> str:
        current = "" if self.current_token is None else f", current token {self.current_token}"
        return f"stale owner of {self.task_id} refused (token {self.token}{current}): {self.reason}"


class TaskAbandonedError(FencedError):
    """The task was taken over ``max_takeovers`` times and is given up (a dead letter).

    It is stored as the task's FAILURE, so ``AsyncResult.get()`` raises it instead of
    waiting forever. ``celery fenced redrive TASK_ID`` puts the task back.
    """

    @classmethod
    def of(cls, task_id: str) -> TaskAbandonedError:
        """The error stored for ``task_id``."""
        return cls(f"task {task_id} was taken over too many times and is abandoned")


class LeaseUnavailableError(FencedError):
    """Stored as the FAILURE of a task whose lease could not be acquired on any of its
    deliveries (the worker sends a delivery again a bounded number of times): the message
    names the last error, a Redis that keeps refusing a command for one."""


class LeaseScriptError(FencedError):
    """A lease script returned a code this version does not know."""


class LeaseInterrupted(_AboutALostLease):
    """Raised into a task body whose lease was lost, out of whatever call it was blocked in.

    Sent by signal (prefork) or as an asynchronous exception (threads, solo) when
    ``fenced_interrupt_on_loss`` is on. It derives from ``BaseException``, so ``except
    Exception`` does not catch it; ``finally`` blocks and ``with`` exits still run. A block
    that must not be cut runs under ``self.shield()``: the interrupt waits for its end. The
    task ends as a lost owner does (``Ignore``: nothing stored); outside the body the public
    API raises :class:`LeaseLostError`.

    Attributes:
        task_id: the task whose lease was lost.
        token: the fencing token the lost owner held.
        reason: why the lease was lost.
    """

    def __str__(self) -> str:
        return f"task {self.task_id} (token {self.token}) interrupted: lease lost: {self.reason}"
