"""What identifies one attempt and what the reaper needs to run it again.

* :func:`next_attempt_id`: the per-attempt part of an owner id, unique per execution.
* :func:`recorded_call`: the original call of a delivery, stored in its lease at acquire, so
  that the reaper can send it again under the same task id.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import uuid
from typing import Any

from .compat import get_actual_ignore_result

__all__ = ["PUBLISH_ID_HEADER", "AttemptIds", "next_attempt_id", "recorded_call", "tag_publish"]

#: The message header naming one ``apply_async`` (the reaper's re-sends keep it): a finished
#: task id applied again runs again, as in Celery, while a copy of a finished run does not.
PUBLISH_ID_HEADER = "fenced_publish_id"

logger = logging.getLogger("celery_fenced.calls")


class AttemptIds:
    """``"<pid>/<random><counter>"``: unique per attempt, between threads, and between processes
    that reuse a pid (the random part is drawn again in every process, forks included: the
    first id a forked child asks for sees its new pid)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Draw a new random part for this process."""
        self._pid = os.getpid()
        self._prefix = uuid.uuid4().hex[:8]
        self._counter = itertools.count()

    def next_id(self) -> str:
        """The next id of this process."""
        if os.getpid() != self._pid:
            self.reset()  # a forked child: the parent's counter and random part are not its own
        return f"{self._pid}/{self._prefix}{next(self._counter):x}"  # next() on a count is atomic


_attempt_ids = AttemptIds()


def next_attempt_id() -> str:
    """``"<pid>/<random><counter>"`` for a new attempt of this process."""
    return _attempt_ids.next_id()


def recorded_call(task: Any, request: Any) -> dict[str, Any] | None:
    """The original call, for the reaper to send again: what ``signature_from_request()``
    gives (task, args, kwargs and options), built without the Signature object.

    Options left at None are left out: the reaper sends with ``send_task``, whose defaults
    are those Nones, and the recorded call is half the size.
    """
    try:
        options = request.as_execution_options()
        options["ignore_result"] = get_actual_ignore_result(task, request)
        delivery_info = request.delivery_info or {}
        priority = delivery_info.get("priority")
        if priority is not None:
            options["priority"] = priority
        routing_key = delivery_info.get("routing_key")
        if delivery_info.get("exchange") == "" and routing_key:
            options["queue"] = routing_key  # sent to the default exchange: the queue is the key
        else:
            options.update(delivery_info)
        return {
            "task": task.name,
            "args": list(request.args or ()),
            "kwargs": request.kwargs or {},
            "options": {name: value for name, value in options.items() if value is not None},
        }
    except Exception:
        logger.exception("could not record the call of task %s; it cannot be re-sent", request.id)
        return None


def tag_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish`` receiver: give each published message its publish id.

    An id already there (a re-send of the reaper) is kept. 64 random bits: it tells apart the
    publishes of one task id, and a finished task's result carries it (``fence_run``).
    """
    if headers is not None and PUBLISH_ID_HEADER not in headers:
        headers[PUBLISH_ID_HEADER] = secrets.token_hex(8)
