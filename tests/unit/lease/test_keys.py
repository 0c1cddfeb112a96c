"""Key names: a lease and its result share a cluster slot; the global key prefix comes first."""

from __future__ import annotations

from redis.crc import key_slot

from celery_fenced._lease.keys import KeySpace


def test_lease_and_result_share_a_cluster_slot(keys: KeySpace) -> None:
    task_id = "0b7f3f5e-1c1a-4a57-9f0a-1d2c3b4a5e6f"
    assert keys.lease(task_id) == f"fenced:lease:{{celery-task-meta-{task_id}}}"
    assert key_slot(keys.lease(task_id).encode()) == key_slot(keys.result(task_id).encode())


def test_global_keyprefix_is_in_front_of_every_key_and_slots_still_match() -> None:
    keys = KeySpace.build("fenced", "app_celery-task-meta-", global_keyprefix="app_")
    assert keys.token == "app_fenced:token"
    assert keys.lease("x") == "app_fenced:lease:{app_celery-task-meta-x}"
    assert key_slot(keys.lease("x").encode()) == key_slot(keys.result("x").encode())
    assert keys.task_id_of(keys.lease("x")) == "x"
