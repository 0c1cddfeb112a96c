"""A finished lease's compact form: the fence a READY result carries in its own meta.

When an owner's READY result is stored, ``store.lua`` deletes the lease: what refusing a late
write needs is in the result itself, kept exactly as long as it. The meta ends with::

    ..., "fence_run": "<publish id>/<attempt>/<takeovers>", "fence_token": <token>}

``fence_token`` is the token that wrote it (the contract's name); ``fence_run`` says which
run it ended (the ``apply_async`` that sent it, so a delivery of another one runs again) and
how it got there (``celery fenced inspect`` shows both). The scripts read the tail only
(``fence_of()`` in ``_lib.lua``); :func:`fence_of` here reads it the same way.

A meta that cannot end so (a result serializer other than JSON, a publish id with a quote)
leaves a DONE tombstone hash instead, as a READY result without a token does.

A READY result fenced without its run (``..., "fence_token": <token>}``: a cancel's REVOKED, an
abandoned task's FAILURE) keeps its DONE or ABANDONED hash beside it, but is still read as
finished by that token: a lease hash evicted or lost while its result stays must not let an
older owner write back its lease, or its result over that one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from celery import states

__all__ = ["FENCE_RUN", "FinishedFence", "fence_of", "run_text"]

#: The meta key naming the run a READY result ended.
FENCE_RUN = "fence_run"

_SAFE_PUBLISH_ID = re.compile(r"[0-9A-Za-z_.:-]*")
_TAIL = re.compile(rb'"fence_run": "([^"]*)", "fence_token": (\d+)}$')
_STATUS = re.compile(rb'^{"status": "([A-Z]+)"')
_RUN = re.compile(r"^(.*)/(\d+)/(\d+)$")
#: How far from the end the tail is looked for (the scripts look as far).
_TAIL_REACH = 120
#: A READY result fenced without its run: ``..., "fence_token": <token>}``.
_BARE_TAIL = re.compile(rb'"fence_token": (\d+)}$')
_BARE_TAIL_REACH = 40


def run_text(publish_id: str, attempt: int, takeovers: int) -> str | None:
    """``fence_run``'s value, or ``None`` for a publish id that cannot be carried as is."""
    if len(publish_id) > 64 or not _SAFE_PUBLISH_ID.fullmatch(publish_id):
        return None
    return f"{publish_id}/{attempt}/{takeovers}"


@dataclass(frozen=True)
class FinishedFence:
    """What a finished task's result says of its lease.

    Attributes:
        token: the token that wrote the result (the lease's last ``ownerToken``).
        state: the READY state stored.
        publish_id: the ``apply_async`` whose run it ended (``""`` when none was named).
        attempt: executions of the task id that acquired.
        takeovers: reaper claims that counted as takeovers.
    """

    token: int
    state: str
    publish_id: str
    attempt: int
    takeovers: int

    def lease_fields(self) -> dict[str, str]:
        """The DONE lease it stands for, as the hash's fields (for ``LeaseState``)."""
        fields = {
            "status": "DONE",
            "ownerToken": str(self.token),
            "attempt": str(self.attempt),
            "takeovers": str(self.takeovers),
            "resultState": self.state,
        }
        if self.publish_id:
            fields["publishId"] = self.publish_id
        return fields


def fence_of(meta: bytes | str | None) -> FinishedFence | None:
    """The fence of a stored READY result; ``None`` for any other value."""
    if not meta:
        return None
    raw = meta.encode() if isinstance(meta, str) else meta
    status = _STATUS.match(raw)
    if status is None or status.group(1).decode() not in states.READY_STATES:
        return None
    tail = _TAIL.search(raw, max(0, len(raw) - _TAIL_REACH))
    if tail is None:
        # Fenced without its run (a cancel's REVOKED, an abandoned task's FAILURE): finished by
        # that token, its run unknown (read as the scripts read it: attempt 1, no takeovers).
        bare = _BARE_TAIL.search(raw, max(0, len(raw) - _BARE_TAIL_REACH))
        if bare is None:
            return None
        return FinishedFence(int(bare.group(1)), status.group(1).decode(), "", 1, 0)
    run = _RUN.match(tail.group(1).decode())
    if run is None:
        return None
    publish_id, attempt, takeovers = run.groups()
    return FinishedFence(int(tail.group(2)), status.group(1).decode(), publish_id, int(attempt), int(takeovers))
