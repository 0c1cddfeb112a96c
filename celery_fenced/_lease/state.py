"""The values the lease store reads and answers: statuses, outcomes and the lease snapshot.

Plain data, no Redis: :class:`LeaseState` is a read-only snapshot of one lease hash, the
other classes are what :class:`~celery_fenced._lease.store.LeaseStore`'s methods take and return.
Times are milliseconds of the Redis server's clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from kombu.utils import json

from .._celery.compat import StrEnum
from ..exceptions import LeaseScriptError
from .fields import FIELDS, typed

__all__ = [
    "SCRIPT_OUTCOMES",
    "AcquireOutcome",
    "AcquireResult",
    "BeginEpochOutcome",
    "CancelOutcome",
    "CancelResult",
    "Checkpoint",
    "ClaimOutcome",
    "ClaimResult",
    "ConfirmEpochOutcome",
    "ForgetOutcome",
    "LapseNowOutcome",
    "LapseOutcome",
    "LapseWorkerOutcome",
    "LeaseState",
    "LeaseStatus",
    "ProgressReport",
    "RedriveOutcome",
    "ReleaseOutcome",
    "RenewOutcome",
    "RenewRequest",
    "Reservation",
    "ReserveOutcome",
    "RestoreOutcome",
    "StoreOutcome",
    "StoreResult",
    "as_text",
    "outcome",
]


class LeaseStatus(StrEnum):
    """The statuses of a lease (see the state table in ``docs/design.rst``)."""

    RUNNING = "RUNNING"
    LAPSED = "LAPSED"
    REQUEUED = "REQUEUED"
    RETRYING = "RETRYING"
    STALLED = "STALLED"
    DONE = "DONE"
    ABANDONED = "ABANDONED"
    RESERVED = "RESERVED"
    HANDED_OFF = "HANDED_OFF"


class AcquireOutcome(StrEnum):
    """What an acquire did."""

    NEW = "new"
    TAKEOVER = "takeover"
    DUPLICATE = "duplicate"
    DONE = "done"
    ABANDONED = "abandoned"
    HANDED_OFF = "handed-off"

    @property
    def runs(self) -> bool:
        """True when the caller now owns the lease and runs the task body."""
        return self in (AcquireOutcome.NEW, AcquireOutcome.TAKEOVER)


class RenewOutcome(StrEnum):
    """What ``renew.lua`` answered for one lease."""

    OK = "ok"
    STALE_TOKEN = "stale-token"
    NOT_OWNER = "not-owner"
    CLAIMED = "claimed"
    LAPSED = "lapsed"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    RETRYING = "retrying"
    MISSING = "missing"


class LapseOutcome(StrEnum):
    """What ``lapse.lua`` answered."""

    OK = "ok"
    STALE_TOKEN = "stale-token"
    NOT_OWNER = "not-owner"
    NOT_RUNNING = "not-running"
    MISSING = "missing"


class ReleaseOutcome(StrEnum):
    """What ``release.lua`` answered."""

    OK = "ok"
    STALE_TOKEN = "stale-token"
    NOT_OWNER = "not-owner"
    FINISHED = "finished"
    MISSING = "missing"


class StoreOutcome(StrEnum):
    """What ``store.lua`` (the fenced result write) answered."""

    STORED = "stored"
    STALE = "stale"
    FINISHED = "finished"
    LAPSED = "lapsed"
    FOREIGN = "foreign"
    STICKY = "sticky"
    MISSING = "missing"


class ClaimOutcome(StrEnum):
    """What ``claim.lua`` (the reaper) answered for one lease."""

    REQUEUED = "requeued"
    ABANDONED = "abandoned"
    NOT_DUE = "not-due"
    WAITING = "waiting"
    FINISHED = "finished"
    MISSING = "missing"
    RETRY_LATER = "retry-later"


class CancelOutcome(StrEnum):
    """What ``cancel.lua`` answered."""

    CANCELLED = "cancelled"
    FINISHED = "finished"
    UNKNOWN = "unknown"
    RETRY_LATER = "retry-later"


@dataclass(frozen=True)
class CancelResult:
    """What ``cancel.lua`` answered: its code, and the lease's status before it (``""`` for no
    lease; ``"result"`` for a result without one)."""

    code: CancelOutcome
    previous: str

    @property
    def had_owner(self) -> bool:
        """True when an owner held the lease (it learns of the cancel at its next renewal)."""
        return self.previous in (LeaseStatus.RUNNING, LeaseStatus.STALLED)


class RedriveOutcome(StrEnum):
    """What ``redrive.lua`` answered."""

    REDRIVEN = "redriven"
    NOT_ABANDONED = "not-abandoned"
    MISSING = "missing"


class LapseNowOutcome(StrEnum):
    """What ``lapse_now.lua`` (an operator's or a test's "due now") answered."""

    LAPSED = "lapsed"
    RETRYING = "retrying"
    NOT_LIVE = "not-live"
    MISSING = "missing"


class RestoreOutcome(StrEnum):
    """What ``restore.lua`` answered."""

    RESTORED = "restored"
    EXISTS = "exists"
    FINISHED = "finished"
    STALE_TOKEN = "stale-token"
    EXPIRED = "expired"


class ForgetOutcome(StrEnum):
    """What ``forget.lua`` (``AsyncResult.forget()``) answered."""

    FORGOTTEN = "forgotten"
    DELETED = "deleted"


class BeginEpochOutcome(StrEnum):
    """What ``begin_epoch.lua`` answered."""

    CURRENT = "current"
    MOVED = "moved"
    BEGUN = "begun"


class ConfirmEpochOutcome(StrEnum):
    """What ``confirm_epoch.lua`` answered."""

    CONFIRMED = "confirmed"
    OTHER = "other"


class LapseWorkerOutcome(StrEnum):
    """What ``lapse_worker.lua`` answered."""

    LAPSED = "lapsed"
    MORE = "more"
    ALIVE = "alive"
    UNKNOWN = "unknown"


class ReserveOutcome(StrEnum):
    """What ``reserve.lua`` answered for one received message."""

    RESERVED = "reserved"
    LEFT = "left"


#: The outcome enum of each script that answers with a code.
SCRIPT_OUTCOMES: Mapping[str, type[StrEnum]] = {
    "acquire": AcquireOutcome,
    "reserve": ReserveOutcome,
    "renew": RenewOutcome,
    "lapse": LapseOutcome,
    "release": ReleaseOutcome,
    "hand_back": ReleaseOutcome,
    "replacement_sent": ReleaseOutcome,
    "store": StoreOutcome,
    "claim": ClaimOutcome,
    "cancel": CancelOutcome,
    "redrive": RedriveOutcome,
    "lapse_now": LapseNowOutcome,
    "restore": RestoreOutcome,
    "forget": ForgetOutcome,
    "begin_epoch": BeginEpochOutcome,
    "confirm_epoch": ConfirmEpochOutcome,
    "lapse_worker": LapseWorkerOutcome,
}


def as_text(value: Any) -> str:
    """A Redis reply value as ``str`` (replies come as bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


E = TypeVar("E", bound=StrEnum)


def outcome(kind: type[E], script: str, code: Any) -> E:
    """The script's answer as a member of its outcome enum; an unknown code is an error."""
    try:
        return kind._value2member_map_[as_text(code)]  # type: ignore[return-value]
    except KeyError:
        raise LeaseScriptError(f"{script}.lua answered an unknown code {as_text(code)!r}") from None


def _flat_fields(flat: Sequence[Any]) -> dict[str, str]:
    """A hash's fields from a flat ``[name, value, …]`` reply, decoded to ``str``."""
    items = [as_text(v) for v in flat]
    return dict(zip(items[::2], items[1::2], strict=True))


def _int(fields: Mapping[str, str], name: str) -> int:
    value = fields.get(name)
    return int(value) if value not in (None, "") else 0


def _opt_int(fields: Mapping[str, str], name: str) -> int | None:
    value = fields.get(name)
    return int(value) if value not in (None, "") else None


class LeaseState:
    """A read-only snapshot of one task's lease hash.

    Every field of the schema (:data:`celery_fenced._lease.fields.FIELDS`) is an attribute,
    named in snake case (``ownerToken`` → ``owner_token``) and read as its kind: text as
    ``str`` (``""`` when unset), ints as ``int`` (``0``), times as milliseconds of the Redis
    server's clock (``None``), JSON objects decoded (``None``; ``details``: ``{}``). ``raw``
    holds the hash's fields as text, those the schema does not know included.
    """

    task_id: str
    raw: Mapping[str, str]
    # The schema's fields, declared for the type checker (a unit test holds them against the
    # schema); their values come from the schema alone (from_fields).
    status: str
    owner_id: str
    owner_token: int
    task_name: str
    attempt: int
    takeovers: int
    max_takeovers: int
    lease_ttl_ms: int
    lease_expire_at: int | None
    heartbeat_at: int | None
    current_stage: str
    progress_version: int
    last_progress_at: int | None
    details: Mapping[str, Any]
    checkpoint: Mapping[str, Any] | None
    call: Mapping[str, Any] | None
    publish_id: str
    reserved_by: str
    reserved_at: int | None
    stalled_at: int | None
    lapsed_at: int | None
    lapse_reason: str
    requeued_at: int | None
    claim_cause: str
    resends: int
    abandon_cause: str
    restored_at: int | None
    finished_at: int | None
    result_state: str
    success_kept: int
    cancelled_at: int | None
    handoff_token: int
    handed_off_at: int | None
    handoff_call: Mapping[str, Any] | None
    forgotten_at: int | None
    trace_context: str

    def __init__(self, task_id: str, raw: Mapping[str, str]) -> None:
        values = {field.attribute: field.read(raw.get(name)) for name, field in FIELDS.items()}
        self.__dict__.update(values, task_id=task_id, raw=raw)

    @classmethod
    def from_fields(cls, task_id: str, fields: Mapping[str, str]) -> LeaseState:
        """Build a snapshot from the hash's fields (already decoded to ``str``)."""
        return cls(task_id, dict(fields))

    @classmethod
    def from_flat(cls, task_id: str, flat: Sequence[Any]) -> LeaseState:
        """Build a snapshot from an ``HGETALL`` answer given as a flat list."""
        return cls.from_fields(task_id, _flat_fields(flat))

    def typed_fields(self) -> dict[str, Any]:
        """The hash's fields by their names, typed as ``celery fenced inspect`` shows them
        (:func:`celery_fenced._lease.fields.typed`)."""
        return typed(self.raw)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a LeaseState is read-only (setting {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a LeaseState is read-only (deleting {name!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LeaseState):
            return NotImplemented
        return (self.task_id, dict(self.raw)) == (other.task_id, dict(other.raw))

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[type[LeaseState], tuple[str, dict[str, str]]]:
        return LeaseState, (self.task_id, dict(self.raw))

    def __repr__(self) -> str:
        shown = ", ".join(f"{field.attribute}={getattr(self, field.attribute)!r}" for field in _REPR_FIELDS)
        return f"LeaseState(task_id={self.task_id!r}, {shown})"

    @property
    def is_live(self) -> bool:
        """True while an owner holds the lease (RUNNING or STALLED)."""
        return self.status in (LeaseStatus.RUNNING, LeaseStatus.STALLED)

    @property
    def is_finished(self) -> bool:
        """True once the task will not run again (DONE or ABANDONED)."""
        return self.status in (LeaseStatus.DONE, LeaseStatus.ABANDONED)


#: What a snapshot's ``repr()`` shows: the schema's first fields (status, owner, token, counts).
_REPR_FIELDS = tuple(FIELDS.values())[:6]


def _json_object(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)  # type: ignore[no-untyped-call]
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Checkpoint:
    """The last progress an earlier owner of a task id published: where a new owner resumes.

    ``self.checkpoint`` of a :class:`~celery_fenced.ProgressLeasedTask` gives it to a
    takeover, and to a retry (the same task id); ``None`` when no earlier owner published
    progress (always on a first attempt). It is published at the heartbeat's pace, so it may
    be up to one heartbeat interval older than the owner's last ``progress()`` call.
    """

    #: The stage of that owner's last published progress (``None`` when it had none).
    stage: str | None
    #: Its last published ``progress()`` details.
    details: Mapping[str, Any]
    #: The attempt number of the owner that published it.
    attempt: int
    #: The fencing token of the owner that published it.
    token: int

    @classmethod
    def from_json(cls, text: str) -> Checkpoint | None:
        """Read the checkpoint the acquire answered (``None`` for ``""`` or an unreadable one)."""
        fields = _json_object(text)
        if not fields:
            return None
        details = fields.get("details")
        return cls(
            stage=fields.get("stage") or None,
            details=details if isinstance(details, dict) else {},
            attempt=int(fields.get("attempt") or 0),
            token=int(fields.get("token") or 0),
        )


@dataclass(frozen=True)
class AcquireResult:
    """The answer of :meth:`LeaseStore.acquire`; ``checkpoint`` only for a takeover or a retry.

    ``token``, ``attempt`` and ``takeovers`` are read from the script's answer at once (every
    task needs them); the whole snapshot, :attr:`state`, only when asked for.

    Attributes:
        token: the token of the lease's owner (this attempt's when it runs).
        attempt: executions that acquired the lease, this one included when it runs.
        takeovers: how many times the reaper took the task over.
    """

    task_id: str
    outcome: AcquireOutcome
    previous_status: str
    snapshot: Sequence[Any] = field(repr=False)  # the script's flat field list
    checkpoint: Checkpoint | None = None
    token: int = 0
    attempt: int = 0
    takeovers: int = 0

    @classmethod
    def first(cls, task_id: str, token: int) -> AcquireResult:
        """A first delivery's answer: ``token``, attempt 1, no takeovers."""
        return cls(task_id, AcquireOutcome.NEW, "", ("ownerToken", token, "attempt", 1, "takeovers", 0), None, token, 1)

    @classmethod
    def from_reply(
        cls,
        task_id: str,
        outcome: AcquireOutcome,
        previous_status: str,
        snapshot: Sequence[Any],
        checkpoint: Checkpoint | None,
    ) -> AcquireResult:
        """An answer with the lease's snapshot (who holds it), its counts read from it."""
        fields = _flat_fields(snapshot)
        counts = (_int(fields, "ownerToken"), _int(fields, "attempt"), _int(fields, "takeovers"))
        return cls(task_id, outcome, previous_status, snapshot, checkpoint, *counts)

    @cached_property
    def _fields(self) -> dict[str, str]:
        return _flat_fields(self.snapshot)

    @cached_property
    def state(self) -> LeaseState:
        """The lease as the script answered it: its snapshot when the delivery does not run
        (who holds it), only the owner's token, attempt and takeovers on a first delivery."""
        return LeaseState.from_fields(self.task_id, self._fields)


@dataclass(frozen=True)
class ProgressReport:
    """An owner's progress as the scripts publish it.

    Attributes:
        stage: the current stage (``""`` when none).
        version: the progress version (how many ``progress()`` calls).
        age_ms: how long ago, by the owner's monotonic clock, that version was made.
        details: JSON of the latest details, ``""`` when they are already published.
    """

    stage: str = ""
    version: int = 0
    age_ms: int = 0
    details: str = ""

    def script_args(self) -> list[Any]:
        """The four script arguments: stage, version, age in ms, details."""
        return [self.stage, self.version, max(0, self.age_ms), self.details]


@dataclass(frozen=True)
class RenewRequest:
    """One lease to renew in a batch (see :meth:`LeaseStore.renew_many`), with the progress
    it publishes; ``stalled`` keeps an alert-mode lease STALLED."""

    task_id: str
    owner_id: str
    token: int
    ttl_ms: int
    progress: ProgressReport
    stalled: bool = False


@dataclass(frozen=True)
class Reservation:
    """One received message to reserve in a batch (see :meth:`LeaseStore.reserve_many`).

    Attributes:
        task_id: the task id.
        expires_in_ms: until the reservation expires: the eta's delay plus the start timeout.
        task_name: the task's registered name.
        call: the recorded call, for the reaper's re-send (``None`` when it could not be recorded).
        max_takeovers: the task's ``max_takeovers``.
        publish_id: the message's publish id (``""`` when none).
        handed_off_by: the token the message says the task id was handed off from (a
            replacement's ``fenced_handed_off_by`` header; ``""`` when none).
    """

    task_id: str
    expires_in_ms: int
    task_name: str
    call: Mapping[str, Any] | None
    max_takeovers: int
    publish_id: str = ""
    handed_off_by: str = ""


@dataclass(frozen=True)
class StoreResult:
    """The answer of :meth:`LeaseStore.store`."""

    code: StoreOutcome
    detail: str

    @property
    def stored(self) -> bool:
        """True when the result was written."""
        return self.code == "stored"


@dataclass(frozen=True)
class ClaimResult:
    """One lease handled by :meth:`LeaseStore.claim_due`."""

    task_id: str
    code: ClaimOutcome
    cause: str
    state: LeaseState | None
