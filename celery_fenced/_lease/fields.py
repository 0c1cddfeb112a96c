"""The lease hash's schema: every field a script writes or reads, its type and its meaning.

This is the one place the fields are named for Python: :func:`typed` parses a hash's values
by it (``celery fenced inspect``), :class:`~celery_fenced._lease.state.LeaseState` takes its
attributes from it (:meth:`LeaseField.read`), and
``docs/design.rst`` lists it (a test holds the two, and the scripts, against each other).
Times are milliseconds of the Redis server's clock.

These are the live lease's fields. A finished one keeps few of them, or none: its result
carries its fence instead (:mod:`celery_fenced._lease.finished`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kombu.utils import json as kombu_json

__all__ = ["FIELDS", "KIND_TYPES", "LeaseField", "is_time", "typed"]

#: What each kind of field is on a :class:`~celery_fenced._lease.state.LeaseState` (``None`` where unset).
KIND_TYPES: Mapping[str, str] = {"text": "str", "int": "int", "time": "int | None", "json": "Mapping[str, Any] | None"}

#: The value of a field the hash does not hold, by kind.
_EMPTY: Mapping[str, Any] = {"text": "", "int": 0, "time": None, "json": None}

#: ``empty`` not given: the kind's.
_KIND_EMPTY: Any = object()

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


@dataclass(frozen=True)
class LeaseField:
    """One field of the lease hash.

    Attributes:
        name: the field's name in the hash.
        kind: ``"text"``, ``"int"``, ``"time"`` (ms since the epoch, server clock) or ``"json"``.
        meaning: what it holds, for the docs.
        attribute: its name on :class:`~celery_fenced._lease.state.LeaseState` (``""``: the name in
            snake case, ``ownerToken`` → ``owner_token``).
        empty: its value there when the hash does not hold it (``""`` for text, ``0`` for an
            int, ``None`` for a time or a JSON value, unless given).
    """

    name: str
    kind: str
    meaning: str
    attribute: str = ""
    empty: Any = _KIND_EMPTY

    def __post_init__(self) -> None:
        if self.kind not in KIND_TYPES:
            raise ValueError(f"lease field {self.name!r}: unknown kind {self.kind!r}")
        if not self.attribute:
            object.__setattr__(self, "attribute", _CAMEL.sub("_", self.name).lower())
        if self.empty is _KIND_EMPTY:
            object.__setattr__(self, "empty", _EMPTY[self.kind])

    def _empty(self) -> Any:
        empty = self.empty
        return dict(empty) if isinstance(empty, dict) else empty  # each snapshot its own

    def read(self, text: str | None) -> Any:
        """The field's value on a :class:`~celery_fenced._lease.state.LeaseState`: ``text`` (the
        hash's value, ``None`` when it holds none) as its kind, or :attr:`empty`.

        JSON is read as kombu reads it (the recorded call's datetimes, UUIDs and bytes come
        back as they were sent); a value that is not an object (or not JSON) reads as
        :attr:`empty`. An int or a time that is not one is an error.
        """
        if text is None or text == "":
            return self._empty()
        kind = self.kind
        if kind == "text":
            return text
        if kind == "json":
            try:
                value = kombu_json.loads(text)  # type: ignore[no-untyped-call]
            except ValueError:
                return self._empty()
            return value if isinstance(value, dict) else self._empty()
        return int(text)


_FIELDS = (
    LeaseField(
        "status", "text", "RUNNING, STALLED, LAPSED, REQUEUED, RETRYING, RESERVED, HANDED_OFF, DONE or ABANDONED"
    ),
    LeaseField("ownerId", "text", "the owner: hostname, pid and a per-attempt id"),
    LeaseField(
        "ownerToken", "int", "the fencing token of the current (or last) owner; after a cancel, the cancel's own"
    ),
    LeaseField("taskName", "text", "the task's registered name"),
    LeaseField("attempt", "int", "executions of the task id that acquired, 1 for the first"),
    LeaseField("takeovers", "int", "reaper claims that counted as takeovers"),
    LeaseField("maxTakeovers", "int", "takeovers allowed before the task is ABANDONED"),
    LeaseField("leaseTtl", "int", "the lease's length, ms", attribute="lease_ttl_ms"),
    LeaseField("leaseExpireAt", "time", "when the lease runs out, or when the reaper looks again"),
    LeaseField("heartbeatAt", "time", "the last accepted renewal"),
    LeaseField("currentStage", "text", "the stage the owner last reported"),
    LeaseField("progressVersion", "int", "progress calls the owner published (grows within a token)"),
    LeaseField("lastProgressAt", "time", "the owner's last progress, as the server's clock places it"),
    LeaseField("details", "json", "the latest progress() details the owner published", empty={}),
    LeaseField("checkpoint", "json", "what an earlier owner published, handed to the next one"),
    LeaseField("call", "json", "the original call (task, args, kwargs, options) the reaper re-sends"),
    LeaseField("publishId", "text", "the apply_async that sent the running copy (a new one runs again)"),
    LeaseField("reservedBy", "text", "the worker that received the message, while RESERVED"),
    LeaseField("reservedAt", "time", "when that worker received it"),
    LeaseField("stalledAt", "time", "when the owner reported a stall (alert mode, or before a release)"),
    LeaseField("lapsedAt", "time", "when it lapsed (a stall, a lost worker, an unfinished body, a redrive)"),
    LeaseField("lapseReason", "text", "why it lapsed: stalled, worker-lost, unfinished, gone, redrive or data-lost"),
    LeaseField("requeuedAt", "time", "when the reaper last claimed it and re-sent the call"),
    LeaseField("claimCause", "text", "why the reaper last claimed it (stalled, gone, resend, retry, …)"),
    LeaseField("claimToken", "int", "the token reserved by that claim: the same claim asked again, same answer"),
    LeaseField("resends", "int", "re-sends of a message that still waits, since the last acquire"),
    LeaseField("abandonCause", "text", "the claim cause that exhausted the takeovers"),
    LeaseField("restoredAt", "time", "when its owner wrote back a lease that had vanished (Redis restart)"),
    LeaseField("primary", "text", "the server (replication id) it was acquired or written back on"),
    LeaseField("finishedAt", "time", "when the task ended (DONE or ABANDONED)"),
    LeaseField("resultState", "text", "the READY state stored with it (a late copy of it is refused)"),
    LeaseField("successKept", "int", "1: a SUCCESS of an earlier run is kept while the task runs again"),
    LeaseField("cancelledAt", "time", "when the cancel command ended it"),
    LeaseField("cancelledFrom", "text", "the status the cancel found (the same cancel asked again, same answer)"),
    LeaseField(
        "cancelledOwnerToken", "int", "the owner's token (current or last) the cancel found; ownerToken: the cancel's"
    ),
    LeaseField(
        "handoffToken", "int", "the token that handed the task id to a replacement; only its message runs since"
    ),
    LeaseField("handedOffAt", "time", "when that owner handed it off"),
    LeaseField("handoffPrior", "int", "a HANDED_OFF record's: the hand-off token its run had, for a hand-back"),
    LeaseField("handoffSent", "int", "a HANDED_OFF record's: 1 once its owner sent the replacement"),
    LeaseField("handoffCall", "json", "a HANDED_OFF record's: the replacement as sent, for the reaper to send again"),
    LeaseField("handoffWorker", "text", "a HANDED_OFF record's: the worker (one start of it) whose process handed off"),
    LeaseField("forgottenAt", "time", "when AsyncResult.forget() deleted the result (the tombstone expires)"),
    LeaseField("traceContext", "text", "the owner's run span (W3C traceparent), while OpenTelemetry records it"),
)

#: Every field of the lease hash, by name.
FIELDS: Mapping[str, LeaseField] = {f.name: f for f in _FIELDS}


def typed(raw: Mapping[str, str]) -> dict[str, Any]:
    """The hash's values typed by the schema: ints and times as ``int``, JSON fields decoded.

    A value that does not parse as its kind, and a field the schema does not know (written
    by a newer version), is kept as text.
    """
    fields: dict[str, Any] = {}
    for name, text in raw.items():
        kind = FIELDS[name].kind if name in FIELDS else "text"
        value: Any = text
        if kind == "json":
            try:
                value = json.loads(text)
            except ValueError:
                value = text
        elif kind in ("int", "time") and text.lstrip("-").isdigit():
            value = int(text)
        fields[name] = value
    return fields


def is_time(name: str) -> bool:
    """True for a field holding a time."""
    return name in FIELDS and FIELDS[name].kind == "time"
