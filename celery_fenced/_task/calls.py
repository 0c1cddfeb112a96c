"""What identifies one attempt and what the reaper needs to run it again.

* :class:`AttemptIds`: the per-attempt part of an owner id, unique per execution (a worker
  process keeps its own: :mod:`celery_fenced._worker.process`).
* :func:`recorded_call`: the original call of a delivery, stored in its lease at acquire, so
  that the reaper can send it again under the same task id.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import secrets
import uuid
from collections.abc import Mapping
from typing import Any

from .._celery.compat import get_actual_ignore_result
from .._celery.headers import HANDED_OFF_BY_HEADER, PUBLISH_ID_HEADER
from .running import current_lease

__all__ = [
    "AttemptIds",
    "mark_replacement",
    "name_callbacks",
    "recorded_call",
    "retry_call",
    "tag_publish",
]

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


def retry_call(
    call: Mapping[str, Any] | None, retries: int, args: Any, kwargs: Any, options: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The call a ``retry()`` sends, built from the retried run's recorded ``call``: its new
    ``args`` and ``kwargs`` where given, ``retries``, and the options given to ``retry()``
    (its ``eta`` and ``countdown`` aside: the reaper sends it again only once it is overdue).
    ``None`` when the run recorded no call, or the retry's cannot be recorded (JSON)."""
    if not call:
        return None
    retry_options = dict(call.get("options") or {})
    retry_options.update(
        {name: value for name, value in options.items() if value is not None and name not in ("eta", "countdown")}
    )
    retry_options["retries"] = retries
    made = {
        "task": call.get("task"),
        "args": list(call.get("args") or ()) if args is None else list(args),
        "kwargs": dict(call.get("kwargs") or {}) if kwargs is None else dict(kwargs),
        "options": retry_options,
    }
    try:
        json.dumps(made)
    except (TypeError, ValueError):
        logger.warning(
            "the retry of task %s is not JSON-serialisable: an overdue retry is sent as the run that retried",
            call.get("task"),
        )
        return None
    return made


def mark_replacement(sig: Any, task_id: str, publish_id: str, token: int) -> bool:
    """Put the hand-off's headers on the signature of ``sig`` that runs under ``task_id``.

    ``Task.replace()`` gives the replacement the replaced task's id: ``sig`` itself, the last
    task of a chain, the body of a chord, or a task of a chain the replaced task was part of.
    That message names the token it was handed off from, and keeps the replaced run's publish
    id (a copy of either message is then one run: once finished, neither runs again). Every
    other step of ``sig`` with an id of its own (a chain's first steps, a chord's header) is
    named a publish derived from the run and its id, so the reaper's re-send of a replacement
    said sent and not started (the broker lost it, or it was late) is a copy of each of its
    steps, not a new run of them. Returns False when no signature of ``sig`` runs under
    ``task_id``.
    """
    carrier = _signature_with_id(sig, task_id)
    if carrier is None:
        return False
    if publish_id:
        for step in _signatures_in(sig):
            step_id = (step.get("options") or {}).get("task_id")
            if not step_id or step_id == task_id or step.get("subtask_type"):
                # The carrier, or a canvas sent as it; or a group, chain or chord itself, whose
                # headers Celery passes down to every task in it (the carrier too, whose own
                # hand-off header they would replace).
                continue
            step_options = step.setdefault("options", {})
            step_headers = dict(step_options.get("headers") or {})
            digest = hashlib.blake2b(f"{publish_id}/{step_id}/replacement".encode(), digest_size=8)
            step_headers.setdefault(PUBLISH_ID_HEADER, digest.hexdigest())
            step_options["headers"] = step_headers
    options = carrier.setdefault("options", {})
    headers = dict(options.get("headers") or {})
    headers[HANDED_OFF_BY_HEADER] = str(token)
    if publish_id:
        headers[PUBLISH_ID_HEADER] = publish_id
    options["headers"] = headers
    return True


def _signatures_in(sig: Any) -> list[Any]:
    """``sig`` and every signature (a dict) nested in it: a chain's tasks, a group's, a
    chord's header and body."""
    if not isinstance(sig, dict):
        return []
    found = [sig]
    kwargs = sig.get("kwargs") or {}
    if isinstance(kwargs, dict):
        for name in ("tasks", "header", "body"):
            nested = kwargs.get(name)
            for item in nested if isinstance(nested, (list, tuple)) else [nested]:
                found += _signatures_in(item)
    return found


def _signature_with_id(sig: Any, task_id: str) -> Any:
    """The innermost signature (a dict: a ``Signature`` or its serialized form) in ``sig``
    whose ``task_id`` option is ``task_id``, looked for through chains, groups and chords."""
    if not isinstance(sig, dict):
        return None
    kwargs = sig.get("kwargs") or {}
    inner = [kwargs.get("body")] if isinstance(kwargs, dict) and kwargs.get("body") is not None else []
    for name in ("tasks", "header"):
        nested = kwargs.get(name) if isinstance(kwargs, dict) else None
        if isinstance(nested, dict):
            inner.append(nested)
        elif isinstance(nested, (list, tuple)):
            inner.extend(nested)
    for item in reversed(inner):  # the id is most often the last task's
        found = _signature_with_id(item, task_id)
        if found is not None:
            return found
    # A chain's or a chord's own task_id is its last task's, which sends that task's message.
    return sig if (sig.get("options") or {}).get("task_id") == task_id else None


def tag_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish`` receiver: give each published message its publish id.

    An id already there (a re-send of the reaper) is kept. 64 random bits: it tells apart the
    publishes of one task id, and a finished task's result carries it (``fence_run``).

    A message a fenced owner sends after its body returned and before its result ended the
    lease (a link callback, its chain's next step: Celery sends them before it stores the
    result) gets an id derived from the owner's
    own run and the message's task id instead: every owner of that run, a zombie frozen after
    its last lease check included, sends the same step as the same publish, so a late copy is
    a copy of that run (it does not run again) and not a new run of the task id.
    """
    if headers is not None and PUBLISH_ID_HEADER not in headers:
        headers[PUBLISH_ID_HEADER] = _sent_after_body(headers) or secrets.token_hex(8)


def name_callbacks(callbacks: Any, task_id: str, publish_id: str) -> None:
    """Give each link callback of a run that has no task id one derived from the run.

    Celery picks a callback's id as it sends it, after the body returned; a zombie frozen
    after its last lease check would send its callbacks under ids of their own, which no
    lease can tell from new tasks. Named from the run (its publish id), every owner of the
    run sends a callback under the same id, as the same publish (:func:`tag_publish`): a late
    copy of a fenced callback does not run again. A callback that is a canvas (a chain, a
    group, a chord) is left as it is.
    """
    if not publish_id:
        return
    for index, callback in enumerate(callbacks or ()):
        if not isinstance(callback, dict) or callback.get("subtask_type"):
            continue
        options = callback.get("options")
        if options is None:
            options = callback["options"] = {}
        if not isinstance(options, dict) or options.get("task_id"):
            continue
        digest = hashlib.blake2b(f"{publish_id}/{task_id}/link/{index}".encode(), digest_size=16).digest()
        options["task_id"] = str(uuid.UUID(bytes=digest))


def _sent_after_body(headers: dict[str, Any]) -> str | None:
    """The publish id of a message the running fenced attempt sends after its body and before
    its result ended the lease (Celery's own sends: link callbacks, the chain's next step),
    else None: once the lease ended, a send (from ``on_success``, ``after_return``, a
    ``task_postrun`` receiver) is a new publish, as one from the body is."""
    lease = current_lease()
    if lease is None or not lease.body_done or lease.ended or not lease.publish_id:
        return None
    task_id = headers.get("id")
    if not task_id or headers.get("parent_id") != lease.task_id:
        return None
    return hashlib.blake2b(f"{lease.publish_id}/{task_id}".encode(), digest_size=8).hexdigest()
