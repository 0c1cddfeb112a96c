"""The headers the package adds to Celery's task messages: set by the sender (the task side,
the reaper's re-sends, a replacement's hand-off) and read by the worker and the reaper."""

from __future__ import annotations

__all__ = ["HANDED_OFF_BY_HEADER", "PASSED_ON_HEADER", "PUBLISH_ID_HEADER"]

#: The message header naming one ``apply_async`` (the reaper's re-sends keep it): a finished
#: task id applied again runs again, as in Celery, while a copy of a finished run does not.
PUBLISH_ID_HEADER = "fenced_publish_id"

#: The header of a re-sent message a worker passed on (its stalled owner held a process
#: there): the workers that did, comma-separated. The reaper's next re-send starts it afresh.
PASSED_ON_HEADER = "fenced_passed_on_by"

#: The header of a replacement sent by ``Task.replace()``: the token of the owner that handed
#: the task id off. After a hand-off only a message naming it runs the task id (retries and the
#: reaper's re-sends keep it); a late copy of the replaced message does not.
HANDED_OFF_BY_HEADER = "fenced_handed_off_by"
