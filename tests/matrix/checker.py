"""The one checker of the result-path matrix: what each path must store, and the verdict.

A cell holds when, for every task id of its path:

* Celery's stored state is the one plain Celery stores for that path on that pool
  (:func:`expected`; :func:`accepted` adds the one other end a takeover allows), and it was
  written for the highest token any execution of the id held (:func:`writer_token`);
* the final step's side effect happened exactly as often as plain Celery would run it (once
  for a path that reaches its end, never for one stopped before it), whatever the fault;
* a client's ``AsyncResult.get(timeout=...)`` returns the value or raises the Celery error of
  the path, and never times out (the paths whose plain Celery stores nothing, ``Ignore`` and
  ``ignore_result``, leave a plain client waiting too: no client waits on them);
* the lease ended (``DONE``; a task id no execution ran never had one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.matrix.scenario import Seen

NOT_STORED = "PENDING"


@dataclass(frozen=True)
class Outcome:
    """What plain Celery stores for a task id of a path, and what its client is answered."""

    state: str
    #: The exception type ``get()`` raises (``None``: it returns ``value``).
    error: str | None = None
    value: Any = None
    #: The step whose side effect is the path's end, and how often it happens.
    final_step: str = "finish"
    finals: int = 1
    #: Whether a client waits on it (plain Celery stores nothing for ``Ignore``, ``ignore_result``).
    waited: bool = True


def _limits_ignored(pool: str, soft: bool) -> bool:
    """threads and solo ignore both time limits; gevent runs only the hard one (its pool
    takes ``timeout``, not ``soft_timeout``)."""
    return pool in ("threads", "solo") or (soft and pool == "gevent")


def expected(pool: str, path: str, role: str) -> Outcome:
    """What plain Celery stores for ``path`` on ``pool`` (checked against the plain twins)."""
    ran_to_its_end = Outcome("SUCCESS", value="ran to its end")
    if path == "success":
        return Outcome("SUCCESS", value="success")
    if path == "failure":
        return Outcome("FAILURE", error="ValueError")
    if path == "retry":
        return Outcome("SUCCESS", value="retried")
    if path == "replace":
        return Outcome("SUCCESS", value="replacement", final_step="replacement")
    if path == "reject":
        return Outcome("FAILURE", error="Reject")
    if path == "ignore":
        # Nothing but STARTED (task_track_started) is stored: a client would wait for ever.
        return Outcome("STARTED", waited=False)
    if path == "ignore_result":
        return Outcome(NOT_STORED, waited=False)
    if path == "revoke":
        return Outcome("REVOKED", error="TaskRevokedError", finals=0)
    if path == "revoke_terminate":
        # Only prefork and gevent can terminate a running task (the others' terminate_job
        # raises NotImplementedError): there the body runs to its end.
        if pool in ("threads", "solo"):
            return ran_to_its_end
        return Outcome("REVOKED", error="TaskRevokedError", finals=0)
    if path == "soft_time_limit":
        return (
            ran_to_its_end
            if _limits_ignored(pool, soft=True)
            else Outcome("FAILURE", error="SoftTimeLimitExceeded", finals=0)
        )
    if path == "hard_time_limit":
        return (
            ran_to_its_end
            if _limits_ignored(pool, soft=False)
            else Outcome("FAILURE", error="TimeLimitExceeded", finals=0)
        )
    if path == "forget":
        # The client got its value, then forgot it: nothing is stored any more, for good.
        return Outcome(NOT_STORED, value="success")
    if path == "chord_part":
        return Outcome("SUCCESS", value=2) if role == "callback" else Outcome("SUCCESS", value=None)
    if path == "group_member":
        return Outcome("SUCCESS", value=None)
    raise KeyError(path)


def accepted(pool: str, path: str, role: str, seen: Seen) -> list[Outcome]:
    """The outcomes a cell may end with: what plain Celery stores (:func:`expected`); and, for
    a revoke a pool could not terminate whose owner was then lost (the task sent again, a
    takeover), REVOKED too: the copy is discarded by a worker that knew of the revoke, as Celery
    discards any copy of a revoked id (a worker that had not read the revoke yet runs it)."""
    outcomes = [expected(pool, path, role)]
    taken_over = seen.lease.get("takeovers", "0") not in ("", "0")
    if path == "revoke_terminate" and pool in ("threads", "solo") and taken_over:
        outcomes.append(Outcome("REVOKED", error="TaskRevokedError", finals=0))
    return outcomes


def verdict(outcomes: list[Outcome], seen: Seen, path: str) -> list[str]:
    """No problem when ``seen`` ends as one of ``outcomes``; else the problems against the first."""
    found = [problems(outcome, seen, path) for outcome in outcomes]
    return [] if any(not f for f in found) else found[0]


def client_problem(outcome: Outcome, seen: Seen) -> str | None:
    if not outcome.waited:
        return None
    answer = seen.client
    if answer[0] == "timeout":
        return "the client was left waiting (get() timed out)"
    if answer[0] == "not waited":
        return "no client asked"
    if outcome.error is not None:
        if answer[0] != "error" or answer[1] != outcome.error:
            return f"get() answered {answer!r}, expected it to raise {outcome.error}"
        return None
    if answer[0] != "value":
        return f"get() raised {answer[1:]!r}, expected a value"
    if outcome.value is not None and answer[1] != outcome.value:
        return f"get() returned {answer[1]!r}, expected {outcome.value!r}"
    return None


def problems(outcome: Outcome, seen: Seen, path: str) -> list[str]:
    """Everything about ``seen`` that differs from ``outcome``."""
    found = []
    client = client_problem(outcome, seen)
    if client:
        found.append(client)
    if seen.state != outcome.state:
        result = (seen.meta or {}).get("result")
        found.append(f"stored {seen.state} ({result!r}), expected {outcome.state}")
    tokens = [entry["token"] for entry in seen.steps if entry["token"] is not None]
    if seen.fenced and seen.meta is not None and tokens and writer_token(seen) != max(tokens):
        found.append(f"stored by token {writer_token(seen)}, the highest token that ran is {max(tokens)}")
    finals = seen.count(outcome.final_step)
    if finals != outcome.finals:
        found.append(f"step {outcome.final_step!r} happened {finals} time(s), expected {outcome.finals}")
    # A task id no execution ran (revoked before it was sent) never had a lease to end.
    never_ran = not seen.steps and not seen.lease
    if seen.fenced and path != "forget" and not never_ran and seen.lease.get("status") != "DONE":
        found.append(f"lease {seen.lease.get('status')!r}, expected DONE")
    return found


def writer_token(seen: Seen) -> int | None:
    """The token the stored result was written for: its ``fence_token``; for a READY state
    Celery's main process wrote for the owner (a time limit, a terminate), which carries none,
    the owner's token its write ended the lease of (the DONE tombstone's ``ownerToken``)."""
    assert seen.meta is not None
    token = seen.meta.get("fence_token")
    if token is None and seen.lease.get("status") == "DONE" and seen.lease.get("ownerToken"):
        return int(seen.lease["ownerToken"])
    return int(token) if token is not None else None


def describe(seen: Seen) -> str:
    steps = ", ".join(f"{s['step']}@{s['token']}/{s['hostname'].split('@')[0]}/{s['pid']}" for s in seen.steps)
    lease = {k: seen.lease.get(k) for k in ("status", "ownerToken", "attempt", "takeovers")}
    return f"{seen.role} {seen.task_id}: state {seen.state}, client {seen.client!r}, lease {lease}, steps [{steps}]"
