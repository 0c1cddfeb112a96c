"""What a renewal announces to Flower: an attempt once, then each new stage or new details."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_fenced._task.owner import OwnedLease
from celery_fenced._telemetry import events
from celery_fenced._worker.listener import WorkerListener
from celery_fenced.conf import FencedConfig


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The task-progress events the listener sends (what it hands to the event dispatcher)."""
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(
        events,
        "send_about",
        lambda app, kind, lease, **fields: seen.append({"type": kind, "stage": lease.stage, **fields}),
    )
    return seen


def lease() -> OwnedLease:
    return OwnedLease("t1", "proj.task", "host/1/a", 7, 1, 0, FencedConfig.from_mapping({}).policy)


def renewed(listener: WorkerListener, owned: OwnedLease) -> None:
    """What the heartbeat does after an accepted renewal."""
    owned.watch.renewed_at(owned.renewed, owned.report(0.0)[1])
    listener.renewed([owned])


def test_the_first_renewal_announces_the_attempt_then_only_changes_do(sent: list[dict[str, Any]]) -> None:
    listener, owned = WorkerListener(Celery("t", set_as_current=False)), lease()
    renewed(listener, owned)
    assert [e["stage"] for e in sent] == [None]  # the attempt and its token, once
    renewed(listener, owned)
    owned.progress("load")
    renewed(listener, owned)
    owned.progress("load")
    renewed(listener, owned)
    owned.progress("load", {"done": 3})
    renewed(listener, owned)
    assert [(e["stage"], e["details"]) for e in sent] == [(None, {}), ("load", {}), ("load", {"done": 3})]


def test_a_takeover_announced_at_acquire_is_not_announced_again_by_its_first_renewal(
    sent: list[dict[str, Any]],
) -> None:
    listener, owned = WorkerListener(Celery("t", set_as_current=False)), lease()
    assert owned.announce()  # what the acquire of a takeover does, with its own event
    renewed(listener, owned)
    assert sent == []
