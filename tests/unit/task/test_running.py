"""What rides along while a fenced attempt runs (_task/running.py): whether the worker began an
attempt for a request, and the lease of the attempt this thread runs."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from celery.app.task import Context

from celery_fenced._task.owner import OwnedLease
from celery_fenced._task.running import ATTEMPT_ATTRIBUTE, began, current_lease, set_current_lease
from celery_fenced.conf import FencedConfig


def a_lease(task_id: str) -> OwnedLease:
    return OwnedLease(task_id, "proj.task", "host/1/a", 7, 1, 0, FencedConfig.from_mapping({}).policy)


@pytest.fixture(autouse=True)
def no_lease_in_this_thread() -> Iterator[None]:
    assert current_lease() is None
    yield
    set_current_lease(None)


def test_an_attempt_began_for_a_request_that_carries_one() -> None:
    assert began(Context(id="t1", **{ATTEMPT_ATTRIBUTE: object()}))


@pytest.mark.parametrize(
    "request_",
    [Context(id="t1"), Context(id="t1", **{ATTEMPT_ATTRIBUTE: None}), None],
    ids=["an eager call", "an attempt cleared", "no request"],
)
def test_no_attempt_began_for_a_request_without_one(request_: object) -> None:
    assert not began(request_)


def test_the_current_lease_is_the_one_set_in_this_thread() -> None:
    lease = a_lease("t1")
    set_current_lease(lease)
    assert current_lease() is lease
    set_current_lease(None)  # the attempt ended
    assert current_lease() is None


def test_each_thread_has_its_own_current_lease() -> None:
    mine, theirs = a_lease("t1"), a_lease("t2")
    set_current_lease(mine)
    seen: list[OwnedLease | None] = []

    def another_thread() -> None:
        seen.append(current_lease())  # a thread that began no attempt
        set_current_lease(theirs)
        seen.append(current_lease())

    thread = threading.Thread(target=another_thread)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert seen == [None, theirs]
    assert current_lease() is mine  # the other thread's lease is not this thread's
