"""The owner's view of its lease: the no-progress deadline's branches, local expiry, activity."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_fenced import owner
from celery_fenced.conf import FencedConfig
from celery_fenced.exceptions import LeaseLostError
from celery_fenced.owner import OwnedLease, StageDeadline

SETTINGS = {
    "fenced_lease_ttl": 10,
    "fenced_heartbeat_interval": 1,
    "fenced_default_stage_timeout": 5,
    "fenced_stage_timeouts": {"CALL_AI": 30},
}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    now = [1000.0]
    monkeypatch.setattr(owner, "_monotonic", lambda: now[0])
    yield now


def lease_at(now: float) -> OwnedLease:
    policy = FencedConfig.from_mapping(SETTINGS).policy
    return OwnedLease(
        "t1", "proj.task", "host/1/a", 7, 1, 0, policy, last_progress=now, renewed=now, started=now, stage_started=now
    )


def test_outside_a_block_the_stage_table_bounds_the_time_since_the_last_progress(clock: list[float]) -> None:
    lease = lease_at(clock[0])
    assert lease.no_progress_deadline(clock[0] + 2) == (5.0, 2.0, "stage")  # no stage yet: the default
    lease.progress("CALL_AI")
    assert lease.no_progress_deadline(clock[0] + 12) == (30.0, 12.0, "stage")
    lease.progress("unknown-stage")
    assert lease.no_progress_deadline(clock[0] + 6) == (5.0, 6.0, "stage")


def test_a_deadline_block_counts_from_its_start_whatever_progress_says(clock: list[float]) -> None:
    lease = lease_at(clock[0])
    lease.deadline = StageDeadline(stage="DB", first=3, idle=3, total=3, started=clock[0], kind="deadline")
    clock[0] += 2
    lease.progress()  # progress inside a plain deadline does not move it
    assert lease.no_progress_deadline(clock[0] + 0.5) == (3, 2.5, "deadline")
    assert lease.no_progress_deadline(clock[0] + 1.5) == (3, 3.5, "deadline total timeout")


def test_a_stream_waits_first_for_its_first_chunk_then_between_chunks_then_for_its_total(
    clock: list[float],
) -> None:
    lease = lease_at(clock[0])
    block = StageDeadline(stage="CALL_AI", first=10, idle=2, total=60, started=clock[0], kind="stream")
    lease.deadline = block
    assert lease.no_progress_deadline(clock[0] + 4) == (10, 4.0, "first token timeout")
    clock[0] += 4
    block.chunks = 1
    lease.progress()
    assert lease.no_progress_deadline(clock[0] + 1) == (2, 1.0, "idle timeout")
    assert lease.no_progress_deadline(clock[0] + 57) == (60, 61.0, "stream total timeout")


def test_no_renewal_within_the_ttl_less_its_margin_loses_the_lease_without_the_network(clock: list[float]) -> None:
    lease = lease_at(clock[0])
    clock[0] += 8.9  # 10 s TTL, 10 % margin
    lease.progress("LOAD")
    clock[0] += 0.2
    with pytest.raises(LeaseLostError, match="no renewal within the lease ttl"):
        lease.progress("LOAD")
    assert lease.lost_reason is not None
    assert not lease.mark_lost("again")  # reported once


def test_activity_is_taken_once_and_the_end_closes_the_last_stage(clock: list[float]) -> None:
    lease = lease_at(clock[0])
    lease.progress("LOAD")
    clock[0] += 1
    lease.progress("LOAD")
    clock[0] += 2
    lease.progress("SAVE")
    updates, stages = lease.take_activity()
    assert updates == 3
    assert stages == [(None, 0.0, 0.0), ("load", 3.0, 2.0)]  # stage names are normalised
    assert lease.take_activity() == (0, [])
    clock[0] += 4
    assert lease.take_activity(ended=True) == (0, [("save", 4.0, 4.0)])


def test_progress_details_json_cannot_hold_are_refused(clock: list[float]) -> None:
    lease = lease_at(clock[0])
    with pytest.raises(TypeError, match="progress detail 'rows' must be"):
        lease.progress("LOAD", {"rows": {1, 2}})
