"""The owner's view of its lease: the no-progress deadline's branches, local expiry, activity."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from celery_fenced._task import owner
from celery_fenced._task.owner import OwnedLease, StageDeadline
from celery_fenced.conf import FencedConfig
from celery_fenced.exceptions import LeaseLostError

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
    return OwnedLease("t1", "proj.task", "host/1/a", 7, 1, 0, policy, started=now)


def test_outside_a_block_the_stage_table_bounds_the_time_since_the_last_progress(clock: list[float]) -> None:
    lease = lease_at(clock[0])
    assert lease.no_progress_deadline(clock[0] + 2) == (5.0, 2.0, "stage")  # no stage yet: the default
    lease.progress("CALL_AI")
    assert lease.no_progress_deadline(clock[0] + 12) == (30.0, 12.0, "stage")
    lease.progress("unknown-stage")
    assert lease.no_progress_deadline(clock[0] + 6) == (5.0, 6.0, "stage")


def test_a_deadline_block_counts_from_its_start_whatever_progress_says(clock: list[float]) -> None:
    lease = lease_at(clock[0])
    lease.body.begin_block(StageDeadline(stage="DB", first=3, idle=3, total=3, started=clock[0], kind="deadline"))
    clock[0] += 2
    lease.progress()  # progress inside a plain deadline does not move it
    assert lease.no_progress_deadline(clock[0] + 0.5) == (3, 2.5, "deadline")
    assert lease.no_progress_deadline(clock[0] + 1.5) == (3, 3.5, "deadline total timeout")


def test_a_stream_waits_first_for_its_first_chunk_then_between_chunks_then_for_its_total(
    clock: list[float],
) -> None:
    lease = lease_at(clock[0])
    block = StageDeadline(stage="CALL_AI", first=10, idle=2, total=60, started=clock[0], kind="stream")
    lease.body.begin_block(block)
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
    assert lease.take_activity() == (3, [(None, 0.0, 0.0), ("load", 3.0, 2.0)], True, False)  # names normalised
    assert lease.take_activity() == (0, [], True, False)
    clock[0] += 4
    assert lease.end() == (0, [("save", 4.0, 4.0)], True, False)
    assert lease.take_activity() is None and lease.end() is None  # the end took the rest, once


def test_progress_details_json_cannot_hold_are_refused(clock: list[float]) -> None:
    lease = lease_at(clock[0])
    with pytest.raises(TypeError, match="progress detail 'rows' must be"):
        lease.progress("LOAD", {"rows": {1, 2}})


def test_the_end_takes_the_heartbeats_watch_over_once(clock: list[float]) -> None:
    lease = lease_at(clock[0])
    lease.watch.renewed_at(clock[0], lease.details)
    assert lease.announce()  # a renewal told Flower of the attempt
    lease.progress("LOAD", {"rows": 1})
    activity = lease.end()
    assert activity is not None and activity[0] == 1 and activity[3]  # its last stage is news to Flower
    assert lease.take_activity() is None  # the heartbeat takes nothing more
    assert not lease.announce()  # nor tells Flower anything after the end's own event
    assert lease.end() is None and lease.stop_serving() is None


def test_a_lost_lease_that_stops_serving_hands_no_activity_over(clock: list[float]) -> None:
    lease = lease_at(clock[0])
    lease.progress("LOAD")
    lease.mark_lost("taken over")
    assert lease.stop_serving() is None and lease.ended


def test_every_progress_call_is_counted_once_between_the_heartbeat_and_the_end() -> None:
    policy = FencedConfig.from_mapping(SETTINGS).policy
    for _ in range(20):
        lease = OwnedLease("t1", "proj.task", "host/1/a", 7, 1, 0, policy)
        counted = [0, 0]  # progress calls, stages
        done = threading.Event()

        def heartbeat(lease: OwnedLease = lease, counted: list[int] = counted, done: threading.Event = done) -> None:
            while not done.is_set():
                activity = lease.take_activity()
                if activity is None:
                    return
                counted[0] += activity[0]
                counted[1] += len(activity[1])

        beat = threading.Thread(target=heartbeat)
        beat.start()
        for i in range(2000):
            lease.progress(f"stage-{i // 100}")
        last = lease.end()
        done.set()
        beat.join(5)
        assert last is not None
        assert counted[0] + last[0] == 2000
        assert counted[1] + len(last[1]) == 21  # the stage before the first, 20 stages
