"""The attempt history Flower shows for a fenced task: one entry per attempt, whatever the
order its events arrive in (:class:`AttemptHistory`)."""

from __future__ import annotations

from typing import Any

from ..._telemetry.events import CANCEL_CAUSE, RETRY_CAUSE

__all__ = [
    "ATTEMPTS_LEGEND",
    "ATTEMPT_FIELDS",
    "OUTCOMES",
    "TABLE_MARK",
    "AttemptHistory",
    "cancel_reason",
    "is_cancel",
    "token_of",
]

#: The fields of one entry of ``attempts``.
ATTEMPT_FIELDS = ("attempt", "token", "worker", "started", "ended", "stage", "outcome", "reason")

#: The last thing that happened to an attempt.
OUTCOMES = (
    "running",
    "succeeded",
    "failed",
    "retried",
    "stalled",
    "lease-lost",
    "write-refused",
    "cancelled",
    "abandoned",
)

#: Outcomes no later event of the attempt replaces: what ended it for good.
_FINAL_OUTCOMES = ("cancelled", "abandoned", "succeeded", "failed")
_CELERY_ENDINGS = {
    "task-succeeded": "succeeded",
    "task-failed": "failed",
    "task-retried": "retried",
    "task-revoked": "cancelled",
}
TABLE_MARK = "\u2063celery-fenced-attempts\u2063"  # stands for the table on the task page

#: What the numbers mean, shown under the attempts (and the task's Attempt and Takeovers).
ATTEMPTS_LEGEND = (
    "Attempt: every run that took the lease: the first, each Celery retry (self.retry, autoretry_for) "
    "and each takeover. Takeovers: only the reaper's re-sends of a stalled or dead owner's task; "
    "a retry is not one. So two retries show attempt 3, takeovers 0."
)


class AttemptHistory(list[dict[str, Any]]):
    """The attempts of one task, oldest first, as Flower heard of them (nothing is read from Redis).

    Each entry has :data:`ATTEMPT_FIELDS`; ``token`` is ``None`` for an attempt that ended
    before it sent an event of its own (a short first attempt: Celery's events carry no token).

    The events of one attempt come from several processes (Celery's from the worker's main
    process, the attempt's own from its pool process, the reaper's and an operator's from
    theirs), so they reach Flower in any order. Each is matched to its attempt by what it
    carries: the attempt's own events by token, else by attempt number; the reaper's and an
    operator's (a takeover, an abandon, a cancel), which carry a token of their own, by attempt
    number; Celery's ``task-started``, which carries neither, to the newest entry of its worker
    that has not heard one, else to a new entry numbered next (until an event of the attempt
    says its number); Celery's endings to the oldest open attempt of their worker. So an attempt
    keeps one entry, whatever the order.
    """

    def __init__(self, entries: Any = ()) -> None:
        super().__init__(entries)
        self._known: set[int] = set()  # entries whose number an event said (by position)
        self._started: set[int] = set()  # entries Celery's task-started was heard for
        self._unnumbered: set[int] = set()  # begun before Flower heard of the task: no number guessed
        self._heard_the_message = False  # task-sent or task-received came before any attempt
        self._second_starts: dict[int, Any] = {}  # a task-started heard while the entry ran

    def __str__(self) -> str:
        return TABLE_MARK

    def heard(self, event: dict[str, Any]) -> None:
        """Write what ``event`` says into the attempt it is about.

        An attempt that ended for good (:data:`_FINAL_OUTCOMES`) keeps its outcome: the lease
        loss its owner reports after a cancel, or the refusal of its late write, is no news.
        """
        kind = event.get("type", "")
        when = event.get("timestamp")
        worker = event.get("hostname")
        token = token_of(event.get("token"))
        number = token_of(event.get("attempt")) or None  # 0: no attempt acquired yet
        if kind in ("task-sent", "task-received"):
            self._heard_the_message = self._heard_the_message or not self
            return
        if kind == "task-started":
            self._started_on(worker, when)
            return
        if kind == "task-revoked" and event.get("cause") == CANCEL_CAUSE:
            # The cancel's own event: it carries the cancel's token, which no attempt holds,
            # and the number of the attempt that held the lease.
            # Its owner may have told of the cancel first: the cancel's words are kept.
            entry = self._numbered(number, open_only=True) or self._open_attempt()
            told = self._numbered(number)
            if entry is None and told is not None and told["outcome"] == "cancelled":
                entry = told
            if entry is not None:
                entry.update(outcome="cancelled", reason=cancel_reason(event), ended=entry["ended"] or when)
            return
        if kind in _CELERY_ENDINGS:
            found = self._of_attempt(token, number, worker) if token is not None else self._ended_on(worker)
            entry = found or self._new(worker, when)
            if entry["outcome"] in ("cancelled", "abandoned"):
                return
            entry.update(outcome=_CELERY_ENDINGS[kind], ended=when)
            if kind == "task-failed":
                entry["reason"] = event.get("exception")
            return
        if token is None or not kind.startswith("task-"):
            return
        if kind in ("task-takeover", "task-abandoned"):
            # Sent by the reaper or an operator's command, not by the attempt: about the
            # attempt of its token (a takeover's), else of its number (an abandon stores its
            # FAILURE under a token of its own).
            about = self._by_token(token) or self._numbered(number) or self._placeholder(number)
            if about is None:
                return
            entry = about
            if number is not None and entry["attempt"] == number:
                self._known.add(next(at for at in range(len(self)) if self[at] is entry))
        else:
            entry = self._of_attempt(token, number, worker) or self._begun(worker, when, token, number)
        if event.get("stage"):
            entry["stage"] = event["stage"]
        if entry["outcome"] in _FINAL_OUTCOMES:
            entry["ended"] = entry["ended"] or when
            return
        if kind == "task-progress":
            if entry["outcome"] == "stalled":
                entry["outcome"] = "running"
            if event.get("cause") == RETRY_CAUSE and not entry["reason"]:  # the acquire of a retried run
                entry["reason"] = str(event.get("reason") or "a retry, not a takeover")
        elif kind == "task-stalled":
            entry.update(outcome="stalled", reason=f"no progress within the {event.get('bound') or 'stage'}")
        elif kind == "task-lease-lost":
            reason = str(event.get("reason") or "")
            entry.update(outcome="cancelled" if is_cancel(reason) else "lease-lost", reason=reason)
            entry["ended"] = entry["ended"] or when
        elif kind == "task-takeover" and event.get("cause") == RETRY_CAUSE:
            # The reaper sent a retry again whose message never started: still a retry.
            entry.update(outcome="retried", reason="retried; its retry did not start in time and was sent again")
            entry["ended"] = entry["ended"] or when
        elif kind == "task-takeover":
            if entry["outcome"] in ("running", "stalled"):
                entry.update(outcome="lease-lost", reason=f"taken over ({event.get('cause')})")
            entry["ended"] = entry["ended"] or when
        elif kind == "task-fenced":
            written = event.get("state") or "result"
            current = event.get("current_token")
            entry.update(outcome="write-refused", reason=f"{written} refused: token {token}, current {current}")
            entry["ended"] = entry["ended"] or when
        elif kind == "task-abandoned":
            entry.update(outcome="abandoned", reason=f"takeovers exhausted ({event.get('cause')})")
            entry["ended"] = entry["ended"] or when

    def _new(
        self, worker: str | None, when: Any, token: int | None = None, number: int | None = None
    ) -> dict[str, Any]:
        entry = dict.fromkeys(ATTEMPT_FIELDS)
        guessed = max((other["attempt"] or 0 for other in self), default=0) + 1
        entry.update(attempt=number or guessed, token=token, worker=worker, started=when, outcome="running")
        self.append(entry)
        if number is not None:
            self._known.add(len(self) - 1)
        return entry

    def _started_on(self, worker: str | None, when: Any) -> None:
        """Celery's ``task-started``: the start of the attempt its worker's events began, or of a new one."""
        at = len(self) - 1
        last = self[at] if self else None
        if last is not None and last["worker"] in (worker, None):
            own_first = at not in self._started and (_open(last) or at in self._known)
            if not own_first and _open(last) and last["outcome"] == "running" and last["worker"] == worker:
                # A second start while it runs: a duplicate delivery (it does not run), or the
                # next attempt of a retry whose task-retried comes later (its own event says so).
                self._second_starts[at] = when
                return
            if own_first:
                last["worker"] = worker
                begun = [time for time in (last["started"], when) if time is not None]
                last["started"] = min(begun) if begun else None
                self._started.add(at)
                return
        unnumbered = not self and not self._heard_the_message
        self._new(worker, when)
        self._started.add(len(self) - 1)
        if unnumbered:  # Flower heard of the task mid-way: its first event says the number
            self._unnumbered.add(len(self) - 1)

    def _begun(self, worker: str | None, when: Any, token: int, number: int | None) -> dict[str, Any]:
        """A new entry for an attempt first heard of by an event of its own.

        Where its worker's newest attempt heard a second ``task-started``, that was this one's.
        """
        at = next((at for at in reversed(range(len(self))) if self[at]["worker"] == worker), None)
        second = self._second_starts.pop(at, None) if at is not None else None
        entry = self._new(worker, second if second is not None else when, token, number)
        if second is not None:
            self._started.add(len(self) - 1)
        return entry

    def _of_attempt(self, token: int, number: int | None, worker: str | None) -> dict[str, Any] | None:
        """The entry of the attempt an event of its own is about: by token, else by number."""
        entry = self._by_token(token)
        if entry is None and number is not None:
            entry = next(
                (
                    self[at]
                    for at in reversed(range(len(self)))
                    if at in self._known and self[at]["attempt"] == number and self[at]["token"] is None
                ),
                None,
            )
        entry = entry or self._adopt(number, worker)
        if entry is None:
            return None
        at = next(at for at in range(len(self)) if self[at] is entry)
        entry["token"] = token if entry["token"] is None else entry["token"]
        entry["worker"] = entry["worker"] or worker
        if number is not None:
            entry["attempt"] = number
            self._known.add(at)
        return entry

    def _by_token(self, token: int | None) -> dict[str, Any] | None:
        return next((entry for entry in self if token is not None and entry["token"] == token), None)

    def _adopt(self, number: int | None, worker: str | None) -> dict[str, Any] | None:
        """The attempt Celery's ``task-started`` began on ``worker``, whose token is heard now.

        Only the newest entry of that worker, while its number is a guess that fits (a retry's
        next attempt on the same worker is not the attempt it retries), ended or not: Celery's
        ending can come first (a renewal in flight as the body returns announces the attempt
        after it ended).
        """
        for at in reversed(range(len(self))):
            entry = self[at]
            if entry["worker"] != worker:
                continue
            if entry["token"] is not None or at in self._known:
                return None
            if at in self._unnumbered or (number is not None and entry["attempt"] == number):
                return entry
            if number is None and (_open(entry) or entry["outcome"] == "cancelled"):
                return entry
            return None
        return None

    def _numbered(self, number: int | None, open_only: bool = False) -> dict[str, Any] | None:
        """The newest entry of attempt ``number`` (open, with ``open_only``)."""
        if number is None:
            return None
        return next(
            (entry for entry in reversed(self) if entry["attempt"] == number and (_open(entry) or not open_only)),
            None,
        )

    def _placeholder(self, number: int | None) -> dict[str, Any] | None:
        """An attempt the reaper speaks of before Flower heard of it (or never will)."""
        if number is None or any((entry["attempt"] or 0) >= number for entry in self):
            return None
        return self._new(None, None, None, number)

    def _open_attempt(self) -> dict[str, Any] | None:
        """The newest attempt that has not ended (the one an operator's action ends)."""
        return next((entry for entry in reversed(self) if _open(entry)), None)

    def _ended_on(self, worker: str | None) -> dict[str, Any] | None:
        """The attempt a tokenless Celery ending from ``worker`` is about: its oldest open one,
        else the newest token's (a zombie sends none)."""
        found = next((entry for entry in self if _open(entry) and entry["worker"] == worker), None)
        return found or self._current()

    def _current(self) -> dict[str, Any] | None:
        """The attempt Celery's own events are about: the newest token's (a zombie sends none)."""
        known = [entry for entry in self if entry["token"] is not None]
        newest = max(known, key=lambda entry: entry["token"]) if known else None
        latest = self[-1] if self else None
        if latest is not None and latest["token"] is None and _open(latest):
            return latest
        return newest or latest


def _open(entry: dict[str, Any]) -> bool:
    return entry["ended"] is None


def cancel_reason(event: dict[str, Any]) -> str:
    said = "cancelled (celery fenced cancel)"
    given = str(event.get("reason") or "")
    return f"{said}: {given}" if given and given != "cancelled" else said


def is_cancel(reason: str) -> bool:
    return "cancelled" in reason and "celery fenced cancel" in reason


def token_of(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
