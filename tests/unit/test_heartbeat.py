"""The heartbeat against a real Redis: what a renewal's refusal means for the owner."""

from __future__ import annotations

import logging

import pytest
import redis

from celery_fenced.conf import FencedConfig
from celery_fenced.heartbeat import Heartbeat
from celery_fenced.keys import KeySpace
from celery_fenced.owner import OwnedLease
from celery_fenced.store import LeaseStore

OWNER = "host/1/a"


class RecordingListener:
    """Records the losses the heartbeat reports (a worker's listener sends signals and events)."""

    def __init__(self) -> None:
        self.losses: list[tuple[str, str]] = []

    def lost(self, lease: OwnedLease, reason: str) -> None:
        self.losses.append((lease.task_id, reason))

    def stalled(self, lease: OwnedLease, bound: str, allowed: float, elapsed: float) -> None:
        pass

    def released(self, lease: OwnedLease) -> None:
        pass

    def duration_exceeded(self, lease: OwnedLease) -> None:
        pass

    def renewed(self, leases: list[OwnedLease]) -> None:
        pass


@pytest.fixture
def store(redis_client: redis.Redis) -> LeaseStore:
    return LeaseStore(redis_client, KeySpace.build("fenced", "celery-task-meta-"))


def owned(store: LeaseStore, task_id: str) -> OwnedLease:
    policy = FencedConfig.from_mapping({}).policy
    state = store.acquire(task_id, OWNER, ttl_ms=policy.lease_ttl_ms, task_name="proj.task", max_takeovers=3).state
    return OwnedLease(
        task_id=task_id,
        task_name="proj.task",
        owner_id=OWNER,
        token=state.owner_token,
        attempt=state.attempt,
        takeovers=state.takeovers,
        policy=policy,
    )


def heartbeat(store: LeaseStore, listener: RecordingListener, *leases: OwnedLease) -> Heartbeat:
    beat = Heartbeat(store_factory=lambda: store, listener=listener, default_interval=60)
    for lease in leases:
        beat._leases[lease.owner_id] = lease  # served, without starting the thread: tick() by hand
    return beat


def store_success(store: LeaseStore, lease: OwnedLease) -> None:
    outcome = store.store(
        lease.task_id, lease.token, b'{"status": "SUCCESS"}', state="SUCCESS", kind="ready", expires_ms=0
    )
    assert (outcome.code, outcome.detail) == ("stored", "DONE")


def test_a_renewal_racing_the_owners_own_result_write_is_not_a_loss(
    store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    listener = RecordingListener()
    lease = owned(store, "t1")
    beat = heartbeat(store, listener, lease)
    lease.body_done = True  # the body returned; its SUCCESS write lands before the tick's renewal
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
    assert listener.losses == [("t2", "renewal refused: the task was ended (result stored or cancelled)")]
    assert lease.lost_reason is not None


def test_a_vanished_lease_is_written_back_by_its_live_owner(store: LeaseStore, redis_client: redis.Redis) -> None:
    listener = RecordingListener()
    lease = owned(store, "t3")
    lease.call = {"task": "proj.task", "args": [1], "kwargs": {}, "options": {"queue": "q"}}
    beat = heartbeat(store, listener, lease)
    redis_client.delete(store.keys.lease("t3"))  # evicted, flushed, or lost in a failover
    beat.tick()
    assert listener.losses == [] and lease.lost_reason is None
    state = store.read("t3")
    assert state is not None and state.status == "RUNNING" and state.owner_token == lease.token
    assert state.call == lease.call and "restoredAt" in state.raw  # the reaper can still re-send it


def test_a_renewal_racing_a_hand_off_does_not_write_the_lease_back(store: LeaseStore) -> None:
    listener = RecordingListener()
    lease = owned(store, "t4")
    beat = heartbeat(store, listener, lease)
    lease.ended = True  # replace(): the attempt ends its lease, then hands the task id off
    assert store.hand_off("t4", OWNER, lease.token) == "ok"
    beat._renew([(lease, False)])  # a renewal that was already on its way
    assert store.read("t4") is None  # the replacement starts afresh
