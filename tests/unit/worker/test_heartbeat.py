"""The heartbeat against a real Redis: what a renewal's refusal means for the owner."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_fenced._lease.keys import KeySpace
from celery_fenced._lease.store import LeaseStore
from celery_fenced._task.owner import EXPIRED_LOCALLY, OwnedLease
from celery_fenced._worker.heartbeat import STOPPING_POLL, Heartbeat
from celery_fenced._worker.process import WORKER_PROCESS
from celery_fenced.conf import FencedConfig

OWNER = "host/1/a"


class RecordingListener:
    """Records what the heartbeat reports (a worker's listener sends signals and events)."""

    def __init__(self) -> None:
        self.losses: list[tuple[str, str]] = []
        self.stalls: list[tuple[str, str, float, float]] = []
        self.releases: list[str] = []
        self.exceeded: list[str] = []
        self.renewals: list[str] = []

    def lost(self, lease: OwnedLease, reason: str) -> None:
        self.losses.append((lease.task_id, reason))

    def stalled(self, lease: OwnedLease, bound: str, allowed: float, elapsed: float) -> None:
        self.stalls.append((lease.task_id, bound, allowed, elapsed))

    def released(self, lease: OwnedLease) -> None:
        self.releases.append(lease.task_id)

    def duration_exceeded(self, lease: OwnedLease) -> None:
        self.exceeded.append(lease.task_id)

    def renewed(self, leases: list[OwnedLease]) -> None:
        self.renewals += [lease.task_id for lease in leases]


@pytest.fixture
def store(redis_client: redis.Redis) -> LeaseStore:
    return LeaseStore(redis_client, KeySpace.build("fenced", "celery-task-meta-"))


def owned(store: LeaseStore, task_id: str, call: dict[str, Any] | None = None, owner_id: str = OWNER) -> OwnedLease:
    policy = FencedConfig.from_mapping({}).policy
    state = store.acquire(task_id, OWNER, ttl_ms=policy.lease_ttl_ms, task_name="proj.task", max_takeovers=3).state
    return OwnedLease(
        task_id=task_id,
        task_name="proj.task",
        owner_id=owner_id,
        token=state.owner_token,
        attempt=state.attempt,
        takeovers=state.takeovers,
        policy=policy,
        call=call,
    )


def heartbeat(store: LeaseStore, listener: RecordingListener, *leases: OwnedLease) -> Heartbeat:
    beat = Heartbeat(store_factory=lambda: store, listener=listener, default_interval=60)
    for lease in leases:
        beat.serve(lease)  # served, without starting the thread: tick() by hand
    return beat


def store_success(store: LeaseStore, lease: OwnedLease) -> None:
    outcome = store.store(
        lease.task_id, lease.token, b'{"status": "SUCCESS"}', state="SUCCESS", kind="ready", expires_ms=0
    )
    assert (outcome.code, outcome.detail) == ("stored", "DONE")


def test_a_lease_dropped_without_unregister_is_no_longer_served(store: LeaseStore) -> None:
    kept, dropped = owned(store, "kept"), owned(store, "dropped", owner_id=OWNER + "-2")
    beat = Heartbeat(store_factory=lambda: store, listener=RecordingListener(), default_interval=60)
    beat.serve(kept)  # served, without starting the thread
    beat.serve(dropped)
    del dropped
    gc.collect()
    assert beat.leases() == [kept]
    assert len(beat._leases) == 1  # pruned, not only skipped


def test_register_starts_the_thread_and_again_after_stop(store: LeaseStore) -> None:
    lease = owned(store, "t1")
    beat = Heartbeat(store_factory=lambda: store, listener=RecordingListener(), default_interval=60)
    try:
        beat.register(lease)
        first = beat._loop.thread
        assert first is not None and first.is_alive()
        beat.register(lease)
        assert beat._loop.thread is first  # one thread per process
        beat.stop()
        assert not first.is_alive()
        beat.register(lease)
        assert beat._loop.thread is not first and beat._loop.thread is not None and beat._loop.thread.is_alive()
        assert beat.leases() == [lease]
        beat.unregister(lease)
        assert beat.leases() == []
    finally:
        beat.stop()


def test_a_renewal_racing_the_owners_own_result_write_is_not_a_loss(
    store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    listener = RecordingListener()
    lease = owned(store, "t1")
    beat = heartbeat(store, listener, lease)
    lease.interrupter.finish_body(
        lambda _: None
    )  # the body returned; its SUCCESS write lands before the tick's renewal
    store_success(store, lease)
    with caplog.at_level(logging.WARNING, logger="celery_fenced.heartbeat"):
        beat.tick()
    assert listener.losses == []
    assert lease.lost_reason is None
    assert "lease lost" not in caplog.text
    assert beat.leases() == []  # no longer served


def test_a_lease_ended_by_someone_else_while_the_body_runs_is_lost(store: LeaseStore) -> None:
    listener = RecordingListener()
    lease = owned(store, "t2")
    beat = heartbeat(store, listener, lease)
    store_success(store, lease)  # as a cancel would: the lease ends under a running body
    beat.tick()
    assert listener.losses == [("t2", "renewal refused: the task was ended (result stored)")]
    assert lease.lost_reason is not None


def test_a_vanished_lease_is_written_back_by_its_live_owner(store: LeaseStore, redis_client: redis.Redis) -> None:
    listener = RecordingListener()
    lease = owned(store, "t3", call={"task": "proj.task", "args": [1], "kwargs": {}, "options": {"queue": "q"}})
    beat = heartbeat(store, listener, lease)
    redis_client.delete(store.keys.lease("t3"))  # evicted, flushed, or lost in a failover
    beat.tick()
    assert listener.losses == [] and lease.lost_reason is None
    state = store.read("t3")
    assert state is not None and state.status == "RUNNING" and state.owner_token == lease.token
    assert state.call == lease.call and "restoredAt" in state.raw  # the reaper can still re-send it


def test_a_frozen_owner_writes_a_vanished_lease_back_only_given_up(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    listener = RecordingListener()
    lease = owned(store, "t5")
    # Its last renewal is a TTL ago (a SIGSTOP, a VM pause): another owner may hold the task,
    # and that owner's lease may have vanished too.
    lease.watch.renewed_at(lease.renewed - lease.policy.lease_ttl - 1)
    lease.body.last_progress = lease.renewed + lease.policy.lease_ttl  # no stall: only the renewal is old
    beat = heartbeat(store, listener, lease)
    redis_client.delete(store.keys.lease("t5"))
    beat.tick()
    # Never back as its own: written back given up (a placeholder for the reaper, due a TTL
    # later, that a newer owner still live replaces), so a task whose only owner it was is not
    # lost with the store's data.
    written = store.read("t5")
    assert written is not None and written.status == "LAPSED"
    assert redis_client.hget(store.keys.lease("t5"), "lapseReason") == b"data-lost"
    assert lease.lost_reason is not None and [task for task, _ in listener.losses] == ["t5"]


def test_a_renewal_racing_a_hand_off_does_not_write_the_lease_back(store: LeaseStore) -> None:
    listener = RecordingListener()
    lease = owned(store, "t4")
    beat = heartbeat(store, listener, lease)
    assert lease.stop_serving() is not None  # replace(): the attempt ends its lease, then hands the task id off
    assert store.hand_off("t4", OWNER, lease.token) == "ok"
    beat._renew([(lease, False)])  # a renewal that was already on its way
    state = store.read("t4")
    assert state is not None and state.status == "HANDED_OFF"  # for the replacement to start afresh
    assert listener.losses == []


# -- on_stall, tick by tick on the heartbeat's own clock -----------------------------------------


def stalling(
    store: LeaseStore, on_stall: str, now: float, call: dict[str, Any] | None = None, **settings: object
) -> OwnedLease:
    """A lease whose body last made progress at ``now``; its stage allows 5 s, two checks."""
    policy = FencedConfig.from_mapping(
        {"fenced_on_stall": on_stall, "fenced_default_stage_timeout": 5, "fenced_stall_checks": 2, **settings}
    ).policy
    state = store.acquire("t1", OWNER, ttl_ms=policy.lease_ttl_ms, task_name="proj.task", max_takeovers=3).state
    return OwnedLease(
        "t1",
        "proj.task",
        OWNER,
        state.owner_token,
        state.attempt,
        0,
        policy,
        call=call,
        started=now,
    )


def clocked(store: LeaseStore, listener: RecordingListener, now: list[float], lease: OwnedLease) -> Heartbeat:
    beat = Heartbeat(store_factory=lambda: store, listener=listener, default_interval=60, clock=lambda: now[0])
    beat.serve(lease)
    return beat


@pytest.mark.parametrize("on_stall", ["release", "expire", "alert"])
def test_within_the_deadline_every_mode_renews(store: LeaseStore, on_stall: str) -> None:
    now, listener = [100.0], RecordingListener()
    lease = stalling(store, on_stall, now[0])
    beat = clocked(store, listener, now, lease)
    now[0] += 4.9
    beat.tick()
    assert listener.renewals == ["t1"] and listener.stalls == [] and listener.losses == []
    assert store.read("t1").status == "RUNNING"  # type: ignore[union-attr]


def test_release_gives_the_lease_up_after_stall_checks_ticks_past_the_deadline(store: LeaseStore) -> None:
    now, listener = [100.0], RecordingListener()
    lease = stalling(store, "release", now[0])
    beat = clocked(store, listener, now, lease)
    now[0] += 5.5
    beat.tick()  # the first failed check: still renewed
    assert listener.stalls == [] and listener.renewals == ["t1"]
    now[0] += 0.5
    beat.tick()
    assert listener.stalls == [("t1", "stage", 5.0, 6.0)]
    assert listener.releases == ["t1"]
    assert listener.losses == [("t1", "stalled: no progress within the stage (5s)")]
    state = store.read("t1")
    assert state is not None and state.status == "LAPSED" and state.raw["lapseReason"] == "stalled"
    beat.tick()  # a lost lease is no longer served
    assert beat.leases() == [] and len(listener.stalls) == 1


def test_expire_stops_renewing_and_tells_the_owner_but_leaves_the_lease_running(store: LeaseStore) -> None:
    now, listener = [100.0], RecordingListener()
    lease = stalling(store, "expire", now[0])
    beat = clocked(store, listener, now, lease)
    now[0] += 5.5
    beat.tick()
    expiry = store.read("t1").lease_expire_at  # type: ignore[union-attr]
    now[0] += 0.5
    beat.tick()
    assert listener.stalls and listener.releases == []
    assert listener.losses == [("t1", "stalled: no progress within the stage (5s); left to expire")]
    state = store.read("t1")
    assert state is not None and state.status == "RUNNING" and "stalledAt" in state.raw
    assert state.lease_expire_at == expiry  # not renewed: the TTL runs out by itself


def test_alert_keeps_renewing_marks_the_lease_stalled_and_reports_once(store: LeaseStore) -> None:
    now, listener = [100.0], RecordingListener()
    lease = stalling(store, "alert", now[0])
    beat = clocked(store, listener, now, lease)
    for _ in range(4):
        now[0] += 3
        beat.tick()
    assert len(listener.stalls) == 1 and listener.losses == []
    assert listener.renewals == ["t1"] * 4
    state = store.read("t1")
    assert state is not None and state.status == "STALLED" and lease.lost_reason is None
    now[0] += 0.1
    lease.body.last_progress = now[0]  # progress again (as progress() leaves it): the stall is over
    beat.tick()
    assert store.read("t1").status == "RUNNING"  # type: ignore[union-attr]


def test_past_max_task_duration_the_listener_is_told_instead_of_a_renewal(store: LeaseStore) -> None:
    now, listener = [100.0], RecordingListener()
    lease = stalling(store, "release", now[0], fenced_max_task_duration=30)
    beat = clocked(store, listener, now, lease)
    now[0] += 30.5
    lease.body.last_progress = now[0]
    beat.tick()
    assert listener.exceeded == ["t1"] and listener.renewals == []


# -- a lease that vanished (a failover that lost writes) and an owner that cannot finish it -----


def test_a_stalled_owner_whose_lease_vanished_writes_it_back_and_gives_it_up(
    store: LeaseStore, redis_client: redis.Redis
) -> None:
    now, listener = [100.0], RecordingListener()
    lease = stalling(store, "release", now[0], call={"task": "proj.task", "args": [1], "kwargs": {}, "options": {}})
    beat = clocked(store, listener, now, lease)
    redis_client.delete(store.keys.lease("t1"))  # lost with a failover
    now[0] += 5.5
    beat.tick()  # renewed: written back
    now[0] += 0.5
    beat.tick()  # stalled: given up, so the reaper takes the task over
    state = store.read("t1")
    assert state is not None and state.status == "LAPSED" and state.call == lease.call
    assert listener.releases == ["t1"]


@pytest.mark.parametrize("vanished", [True, False])
def test_a_lease_given_up_while_redis_was_unreachable_is_written_back_once_it_answers_if_it_vanished(
    redis_client: redis.Redis, vanished: bool
) -> None:
    address = redis_client.connection_pool.connection_kwargs
    # A client that gives up at once while the server does not answer.
    client = redis.Redis(host=address["host"], port=address["port"], socket_timeout=0.2, retry=Retry(NoBackoff(), 0))
    store = LeaseStore(client, KeySpace.build("fenced", "celery-task-meta-"))
    now, listener = [100.0], RecordingListener()
    lease = stalling(
        store,
        "release",
        now[0],
        call={"task": "proj.task", "args": [2], "kwargs": {}, "options": {}},
        fenced_default_stage_timeout=60,
    )
    beat = clocked(store, listener, now, lease)
    redis_client.client_pause(1000)  # Redis does not answer for a second
    now[0] += lease.policy.lease_ttl  # no renewal got through within the TTL
    beat.tick()
    assert lease.lost_reason == EXPIRED_LOCALLY and beat.leases() == []
    if vanished:
        redis_client.delete(store.keys.lease("t1"))  # waits out the pause; the failover lost it meanwhile
    else:
        redis_client.ping()  # waits out the pause
    beat.tick()
    state = store.read("t1")
    assert state is not None
    if vanished:  # written back and given up: the reaper re-sends the task
        assert state.status == "LAPSED" and state.call == lease.call and listener.releases == ["t1"]
    else:  # still there: it expires, and the reaper takes it over as for any owner gone quiet
        assert state.status == "RUNNING" and listener.releases == []
    beat.tick()
    assert listener.releases == (["t1"] if vanished else [])  # looked at once
    store.close()
    client.close()


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_stopping_worker_publishes_new_details_at_once_not_at_the_next_tick(store: LeaseStore) -> None:
    clock = Clock(time.monotonic())
    lease = owned(store, "t1")
    beat = Heartbeat(store_factory=lambda: store, listener=RecordingListener(), default_interval=60, clock=clock)
    beat.serve(lease)
    try:
        assert beat._step() == STOPPING_POLL  # the first tick; it looks again for a stop soon
        lease.progress("process", {"done": 7})  # faster than the heartbeat renews
        clock.now += 1
        beat._step()  # no tick due, the worker not stopping: nothing written
        state = store.read("t1")
        assert state is not None and state.details == {}
        WORKER_PROCESS.stopping.set()  # SIGTERM: the main process sets it for every process
        clock.now += STOPPING_POLL
        beat._step()
        state = store.read("t1")
        assert state is not None and state.details == {"done": 7}
        lease.progress("process", {"done": 8})  # reported while the warm shutdown waits
        clock.now += STOPPING_POLL
        beat._step()
        state = store.read("t1")
        assert state is not None and state.details == {"done": 8}
    finally:
        WORKER_PROCESS.stopping.clear()


def test_a_stopping_worker_does_not_renew_a_stalled_lease(store: LeaseStore) -> None:
    clock = Clock(time.monotonic())
    lease = owned(store, "t1")
    beat = Heartbeat(store_factory=lambda: store, listener=RecordingListener(), default_interval=60, clock=clock)
    beat.serve(lease)
    beat._step()
    lease.body.details = {"done": 1}
    lease.body.last_progress = clock.now - 1000  # far past its deadline
    WORKER_PROCESS.stopping.set()
    try:
        clock.now += STOPPING_POLL
        beat._step()
        state = store.read("t1")
        assert state is not None and state.details == {}
    finally:
        WORKER_PROCESS.stopping.clear()


def test_a_late_wake_is_a_silence_of_the_process(store: LeaseStore) -> None:
    clock = Clock(1000.0)
    lease = owned(store, "t1")
    beat = Heartbeat(store_factory=lambda: store, listener=RecordingListener(), default_interval=5, clock=clock)
    beat.serve(lease)
    wait = beat._step()
    clock.now += wait  # on time: no silence
    wait = beat._step()
    assert beat.silent_between(990.0, clock.now) == 0.0
    due = clock.now + wait
    clock.now = due + 40  # SIGSTOP for 40 s, then SIGCONT: not woken yet
    assert beat.silent_between(990.0, clock.now) == pytest.approx(40.0)
    assert beat.silent_between(due + 30, clock.now) == pytest.approx(10.0)  # only what overlaps
    beat._step()  # woken: the silence is kept
    assert beat._due is not None
    clock.now = beat._due + 4  # a thread late by less than a tick interval (5 s): no silence
    assert beat.silent_between(990.0, clock.now) == pytest.approx(40.0)
    assert beat.silent_between(due + 40, clock.now) == 0.0
    beat._step()
    assert beat.silent_between(990.0, clock.now) == pytest.approx(40.0)
