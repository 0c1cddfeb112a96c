"""The lock a fork takes first (_worker/fork_guard.py): a fork waits for the unit of work that holds
it, and both sides of the fork have it back, unheld.

The fork handler that takes it is the worker runtime's (registered when
:mod:`celery_fenced._worker.runtime` is imported, as it is here).
"""

from __future__ import annotations

import os
import threading
import warnings

import celery_fenced._worker.runtime  # noqa: F401  (registers the fork handler)
from celery_fenced._worker.fork_guard import FORK_GUARD
from tests.support.processes import in_a_forked_child, wait_until

#: How long the unit of work holds the guard once the fork is asked for: a fork that did not
#: wait for it would be done well within this.
HOLD = 0.5


def test_a_fork_waits_for_the_unit_of_work_that_holds_the_guard() -> None:
    held, forking, forked = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []
    went_through_while_held: list[bool] = []

    def unit_of_work() -> None:
        with FORK_GUARD:
            held.set()
            forking.wait(timeout=10)
            went_through_while_held.append(forked.wait(timeout=HOLD))  # the fork must not
            order.append("released")

    worker = threading.Thread(target=unit_of_work)
    worker.start()
    try:
        assert held.wait(timeout=10)
        forking.set()
        with warnings.catch_warnings():  # Python 3.12+: a fork with threads running warns
            warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os._exit(0)  # the child: nothing of pytest's runs here
        order.append("forked")
        forked.set()
        wait_until(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, 10, "the forked child to exit")
    finally:
        worker.join(timeout=10)
    assert not worker.is_alive()
    assert went_through_while_held == [False]
    assert order == ["released", "forked"]
    assert not FORK_GUARD.locked()  # the parent has it back


def test_both_sides_of_a_fork_have_the_guard_back_unheld() -> None:
    assert in_a_forked_child(lambda: {"held in the child": FORK_GUARD.locked()}) == {"held in the child": False}
    assert not FORK_GUARD.locked()
    with FORK_GUARD:  # and it still works in the parent
        assert FORK_GUARD.locked()
