"""What the commands print (listing.py): rows and cells of leases and workers."""

from __future__ import annotations

from celery_fenced._lease.state import LeaseState
from celery_fenced._operator.listing import lease_cells, lease_row, worker_row

NOW = 1_000_000


def lease(status: str, expires_at: int) -> LeaseState:
    fields = {"status": status, "ownerId": "w1/1/a", "ownerToken": "7", "leaseExpireAt": str(expires_at)}
    return LeaseState.from_fields("t1", fields)


def test_an_ended_lease_has_no_time_left_and_a_passed_one_has_none_below_zero() -> None:
    for status in ("DONE", "ABANDONED"):
        row = lease_row(lease(status, NOW - 90_000), NOW)
        assert row["seconds_left"] is None
        assert lease_cells(row)[7] == "-"
    overdue = lease_row(lease("RUNNING", NOW - 2_500), NOW)
    assert overdue["seconds_left"] == 0
    assert lease_cells(overdue)[7] == "0.0s"
    assert lease_row(lease("RUNNING", NOW + 2_500), NOW)["seconds_left"] == 2.5


def test_a_lapsed_worker_record_shows_no_negative_time() -> None:
    row = worker_row("w1@box/42/abc", NOW - 4_000, 2, NOW)
    assert row["seconds_left"] == 0 and row["alive"] is False
