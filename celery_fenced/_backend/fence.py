"""What fences one attempt's result writes: a :class:`WriterFence`, plain data on its request.

The worker puts it on the request once, at acquire (:func:`put_fence`); the fenced backend
reads it at each write (:func:`fence_of`) and needs nothing else of the worker side. It is
frozen: the two things that change while the attempt runs (a ``retry()``'s delay, a late
result stored by the attempt itself) put a new value in its place, on those rare paths only.
A request without one (an eager call, a write from the worker's main process, a process
that runs no worker) writes without a token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["SKIPPED", "WriterFence", "fence_of", "put_fence"]

#: The request attribute the fence rides on.
_ATTRIBUTE = "fenced_writer_fence"


class WriterFence(NamedTuple):
    """What the result writes of one attempt carry, and what they are.

    A named tuple, immutable: built on every task's path, it costs a third of a frozen
    dataclass (whose ``__init__`` sets each field through ``object.__setattr__``).

    Attributes:
        task_id: the task the lease is for (a write for another task id carries no token).
        token: the fencing token of the attempt's lease.
        owner_id: the owner id of the attempt's lease.
        publish_id: the ``apply_async`` whose message the attempt runs (``""`` when none).
        attempt: executions of the task id that acquired, this one included.
        takeovers: reaper claims of the task id before this attempt.
        retry_delay: seconds until the message of the attempt's ``retry()`` is due.
        result_stored: its SUCCESS was stored already (the late result of an owner whose
            lease was lost locally), so the trace's own write of it is skipped.
        skipped: the delivery does not run (a duplicate, a finished task, a lease that could
            not be acquired): every write made for it goes nowhere.
        started_stored: its STARTED result was stored by the acquire itself
            (``task_track_started``), so the trace's own write of it is skipped.
    """

    task_id: str
    token: int
    owner_id: str
    publish_id: str = ""
    attempt: int = 0
    takeovers: int = 0
    retry_delay: float = 0.0
    result_stored: bool = False
    skipped: bool = False
    started_stored: bool = False

    def retried(self, delay: float) -> WriterFence:
        """This fence for the writes after a ``retry()`` whose message is due in ``delay`` seconds."""
        return WriterFence(
            self.task_id, self.token, self.owner_id, self.publish_id, self.attempt, self.takeovers, delay,
            self.result_stored, self.skipped,
        )  # fmt: skip

    def result_written(self) -> WriterFence:
        """This fence once the attempt stored its SUCCESS itself: the trace's own write is skipped."""
        return WriterFence(
            self.task_id, self.token, self.owner_id, self.publish_id, self.attempt, self.takeovers, self.retry_delay,
            True, self.skipped,
        )  # fmt: skip


#: The fence of a delivery that does not run: its writes, STARTED included, go nowhere.
SKIPPED = WriterFence(task_id="", token=0, owner_id="", skipped=True)


def fence_of(request: Any) -> WriterFence | None:
    """The fence on ``request``; ``None`` for a write without a token."""
    fence: WriterFence | None = getattr(request, _ATTRIBUTE, None)
    return fence


def put_fence(request: Any, fence: WriterFence) -> None:
    """Make ``fence`` the one of ``request``'s writes (the worker side, at acquire)."""
    setattr(request, _ATTRIBUTE, fence)
