"""The pytest plugin users test their own tasks with: the fixtures and helpers, in use."""

from __future__ import annotations

import time
from typing import Any

from celery_fenced import LeaseLostError, ProgressLeasedTask
from celery_fenced.exceptions import LeaseInterrupted


def test_a_task_runs_on_the_in_process_worker(fenced_app: Any, fenced_worker: Any, fenced_helpers: Any) -> None:
    @fenced_app.task(bind=True, base=ProgressLeasedTask)
    def build(self: Any) -> int:
        self.progress("load-data")
        return int(self.fencing_token)

    fenced_worker.reload()
    result = build.delay()
    token = result.get(timeout=10)
    state = fenced_helpers.wait_for_lease(result.id, "DONE")
    assert token == state.owner_token >= 1
    fenced_helpers.assert_stale_write_refused(result.id, token - 1 if token > 1 else 1)


def test_a_stage_made_to_stall_is_given_up_and_reaped(fenced_app: Any, fenced_worker: Any, fenced_helpers: Any) -> None:
    lost: list[str] = []

    @fenced_app.task(bind=True, base=ProgressLeasedTask)
    def slow(self: Any) -> str:
        self.progress("load-data")
        try:
            self.progress("persist-result")  # made to wait 4 s: load-data (2 s) stalls
        except (LeaseLostError, LeaseInterrupted) as exc:  # progress() raises the one, the interrupt is the other
            lost.append(exc.reason)
            raise
        return "stored"

    fenced_worker.reload()
    with fenced_helpers.stall_at("persist-result", 4):
        result = slow.delay()
        deadline = time.monotonic() + 10

        def stalled() -> bool:
            state = fenced_helpers.lease(result.id)
            return state is not None and (state.stalled_at is not None or state.takeovers >= 1)

        while not stalled():
            assert time.monotonic() < deadline, "the stall was not seen"
            time.sleep(0.02)
        fenced_helpers.reap()  # the heartbeat's own reap may come first: either way it is re-sent once
        assert result.get(timeout=10) == "stored"  # the re-sent copy
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:  # the zombie wakes after its 4 s
        time.sleep(0.05)
    assert lost and "stalled" in lost[0]
    assert fenced_helpers.lease(result.id).takeovers == 1


def test_lapse_now_makes_a_live_lease_due(fenced_app: Any, fenced_worker: Any, fenced_helpers: Any) -> None:
    @fenced_app.task(bind=True, base=ProgressLeasedTask)
    def waits(self: Any) -> None:
        for _ in range(30):
            self.progress("load-data")
            time.sleep(0.1)

    fenced_worker.reload()
    result = waits.delay()
    fenced_helpers.wait_for_lease(result.id, "RUNNING")
    assert fenced_helpers.lapse_now(result.id) == "lapsed"
    report = fenced_helpers.reap()
    assert report.requeued == [result.id]
    assert fenced_helpers.lease(result.id).status in ("REQUEUED", "RESERVED", "RUNNING", "DONE")
    assert fenced_helpers.lease(result.id).takeovers == 1


def test_the_signals_users_connect_to(fenced_app: Any, fenced_worker: Any, fenced_helpers: Any) -> None:
    from celery_fenced import signals

    seen: dict[str, list[dict[str, Any]]] = {}

    def recorder(name: str) -> Any:
        def receive(sender: Any = None, **kwargs: Any) -> None:
            if sender == "stalls_once" or str(sender).endswith(".stalls_once"):  # not an earlier test's task
                seen.setdefault(name, []).append({"sender": sender, **kwargs})

        return receive

    receivers = {name: recorder(name) for name in signals.__all__}
    for name, receiver in receivers.items():
        getattr(signals, name).connect(receiver)
    try:
        attempts: list[int] = []

        @fenced_app.task(bind=True, base=ProgressLeasedTask, interrupt_on_loss=False)  # it must wake and write
        def stalls_once(self: Any) -> int:
            self.progress("load-data")
            attempts.append(int(self.fencing_token))
            if len(attempts) == 1:
                time.sleep(4)  # the stall under test: no progress, then a late return
            return int(self.fencing_token)

        fenced_worker.reload()
        result = stalls_once.delay()
        token = result.get(timeout=15)
        deadline = time.monotonic() + 10
        while "stale_write_rejected" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)  # the first owner wakes after its 4 s and tries to write
    finally:
        for name, receiver in receivers.items():
            getattr(signals, name).disconnect(receiver)
    assert [(e["attempt"], e["takeover"], e["retry"]) for e in seen["lease_acquired"]] == [
        (1, False, False),
        (2, True, False),
    ]
    assert seen["progress_stalled"][0]["stage"] == "load-data"
    assert seen["progress_stalled"][0]["on_stall"] == "release"
    assert "stalled" in seen["lease_lost"][0]["reason"]
    assert seen["task_taken_over"][0]["cause"] == "stalled" and seen["task_taken_over"][0]["takeovers"] == 1
    assert seen["stale_write_rejected"][0]["current_token"] == token
    assert all(e["sender"] == stalls_once.name for events in seen.values() for e in events)


def test_a_retry_is_acquired_as_a_retry_not_a_takeover(fenced_app: Any, fenced_worker: Any) -> None:
    from celery_fenced import signals

    seen: list[dict[str, Any]] = []

    def receive(sender: Any = None, **kwargs: Any) -> None:
        if str(sender).endswith("retries_once"):
            seen.append(kwargs)

    signals.lease_acquired.connect(receive)
    try:

        @fenced_app.task(bind=True, base=ProgressLeasedTask, max_retries=1)
        def retries_once(self: Any) -> int:
            if self.request.retries == 0:
                raise self.retry(countdown=0)
            return int(self.request.retries)

        fenced_worker.reload()
        assert retries_once.delay().get(timeout=15) == 1
    finally:
        signals.lease_acquired.disconnect(receive)
    assert [(e["attempt"], e["takeover"], e["retry"]) for e in seen] == [(1, False, False), (2, False, True)]
