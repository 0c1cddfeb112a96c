"""The interrupt's state of one attempt (task/interrupter.py): each change under its own lock,
a finished body never interrupted, a shielded one only at the end of its outermost shield."""

from __future__ import annotations

import threading

from celery_fenced._task.interrupter import Interrupter


def interrupter() -> Interrupter:
    return Interrupter(threading.get_ident())


def test_the_delivery_runs_under_the_lock_so_a_landing_meanwhile_waits() -> None:
    target = interrupter()
    seen: list[object] = []

    def deliver() -> bool:
        seen.append(target.lock.locked())
        landed: list[bool | None] = []
        other = threading.Thread(target=lambda: landed.append(target.landing()))  # the gevent hub, say
        other.start()
        other.join(5)
        seen.append(landed)
        return True

    assert target.interrupt(deliver) == "sent"
    assert seen == [True, [None]]  # the hub is told to try again, never blocked
    assert target.sent and not target.lock.locked()
    assert target.landing() is True  # the hub's next turn: raise it
    assert target.landing() is False  # once


def test_a_finished_body_is_never_interrupted() -> None:
    target = interrupter()
    target.finish_body(lambda _: None)
    assert target.interrupt(lambda: True) == "done"
    assert not target.sent and target.signal_landed() is False


def test_an_interrupt_sent_and_not_landed_is_withdrawn_when_the_body_ends() -> None:
    target = interrupter()
    withdrawn: list[tuple[Interrupter, bool]] = []
    target.interrupt(lambda: True)
    target.finish_body(lambda it: withdrawn.append((it, it.lock.locked())))
    assert withdrawn == [(target, True)]  # under the lock: no delivery can slip in between
    assert target.landing() is False  # the hub's callback, run late, raises nothing
    target.finish_body(lambda it: withdrawn.append((it, False)))
    assert len(withdrawn) == 1  # nothing left to withdraw


def test_a_shield_holds_the_interrupt_until_its_outermost_block_ends() -> None:
    target = interrupter()
    target.enter_shield(lambda _: None)
    target.enter_shield(lambda _: None)
    delivered: list[str] = []
    assert target.interrupt(lambda: bool(delivered.append("sent"))) == "held"
    assert delivered == [] and target.pending
    assert target.leave_shield() is False  # the inner block
    assert target.leave_shield() is True  # the outer one: raise it now
    assert not target.pending and target.shield_depth == 0


def test_an_interrupt_sent_before_a_shield_waits_for_its_end() -> None:
    target = interrupter()
    withdrawn: list[Interrupter] = []
    target.interrupt(lambda: True)
    target.enter_shield(withdrawn.append)
    assert withdrawn == [target] and not target.sent and target.pending
    assert target.landing() is False  # withdrawn: it does not land inside the block
    assert target.leave_shield() is True


def test_a_held_interrupt_is_not_due_once_the_body_finished() -> None:
    target = interrupter()
    target.enter_shield(lambda _: None)
    target.interrupt(lambda: True)
    target.finish_body(lambda _: None)
    assert target.leave_shield() is False


def test_the_signal_handler_raises_only_outside_a_shield_and_before_the_end() -> None:
    target = interrupter()
    assert target.signal_landed() is True
    target.enter_shield(lambda _: None)
    assert target.signal_landed() is False and target.pending  # raised at the shield's end
    assert target.leave_shield() is True


def test_no_delivery_runs_after_the_body_finished_whatever_the_interleaving() -> None:
    for _ in range(200):
        target = interrupter()
        after_the_end: list[bool] = []
        go = threading.Barrier(2)

        def heartbeat(target: Interrupter = target, after_the_end: list[bool] = after_the_end) -> None:
            go.wait(5)
            for _ in range(50):
                target.interrupt(lambda: bool(after_the_end.append(target.body_done)))

        sender = threading.Thread(target=heartbeat)
        sender.start()
        go.wait(5)
        target.finish_body(lambda _: None)
        sender.join(5)
        assert not sender.is_alive()
        assert True not in after_the_end  # each delivery saw a body still running
