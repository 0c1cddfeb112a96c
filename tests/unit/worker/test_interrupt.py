"""The interrupt of a lost owner's body (worker/interrupt.py): a BaseException, held off by a shield,
withdrawn once the body ended, by asynchronous exception (threads, solo) or by SIGUSR1 (prefork)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator

import pytest

from celery_fenced._task.owner import OwnedLease
from celery_fenced._task.running import set_current_lease
from celery_fenced._worker import interrupt as interrupts
from celery_fenced._worker.interrupt import end_of_body, install_interrupt_handler, interrupt, shielded
from celery_fenced._worker.process import WORKER_PROCESS
from celery_fenced.conf import FencedConfig
from celery_fenced.exceptions import LeaseInterrupted


def lost_lease(thread_id: int) -> OwnedLease:
    lease = OwnedLease("t1", "proj.task", "host/1/a", 3, 1, 0, FencedConfig.from_mapping({}).policy)
    lease.interrupter.thread_id = thread_id
    lease.mark_lost("taken over")
    return lease


class Body(threading.Thread):
    """A task body in a thread of its own: ``run_body(lease, go)`` until it ends; what stopped it."""

    def __init__(self, run_body: Callable[[OwnedLease, threading.Event], None]) -> None:
        super().__init__(daemon=True)
        self.run_body = run_body
        self.started = threading.Event()
        self.go = threading.Event()
        self.outcome: str | None = None
        self.lease: OwnedLease | None = None

    def run(self) -> None:
        self.lease = lost_lease(threading.get_ident())
        set_current_lease(self.lease)  # as the acquire does: the interrupt reads it
        self.started.set()
        try:
            self.run_body(self.lease, self.go)
            self.outcome = "returned"
        except LeaseInterrupted as exc:
            self.outcome = f"interrupted: {exc.reason}"

    def begin(self) -> OwnedLease:
        self.start()
        assert self.started.wait(5)
        assert self.lease is not None
        return self.lease

    def end(self) -> str | None:
        self.go.set()
        self.join(10)
        assert not self.is_alive()
        return self.outcome


@pytest.fixture(autouse=True)
def threads_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WORKER_PROCESS, "pool_kind", "threads")


def test_a_body_that_swallows_every_exception_is_still_interrupted() -> None:
    swallowed: list[BaseException] = []

    def retries_for_ever(lease: OwnedLease, go: threading.Event) -> None:
        while True:
            try:
                go.wait(0.01)  # a call that fails now and then
            except Exception as exc:  # what real bodies do around such a call
                swallowed.append(exc)

    body = Body(retries_for_ever)
    interrupt(body.begin())
    assert body.end() == "interrupted: taken over"
    assert swallowed == []
    assert not issubclass(LeaseInterrupted, Exception)


def test_a_shield_holds_the_interrupt_until_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    inside = threading.Event()
    steps: list[str] = []

    def writes_under_a_shield(lease: OwnedLease, go: threading.Event) -> None:
        with shielded(lease):
            inside.set()
            while not go.is_set():  # Python code running: an asynchronous exception would land here
                go.wait(0.01)
            steps.append("block finished")
        steps.append("after the block")

    body = Body(writes_under_a_shield)
    lease = body.begin()
    assert inside.wait(5)
    with caplog.at_level(logging.WARNING, logger=interrupts.logger.name):
        interrupt(lease)
    assert "is shielded: interrupted when the block ends" in caplog.text
    assert body.end() == "interrupted: taken over"
    assert steps == ["block finished"]


def test_a_shield_nested_in_another_releases_the_interrupt_only_at_the_outer_end() -> None:
    lease = lost_lease(threading.get_ident())
    steps = []
    with pytest.raises(LeaseInterrupted), shielded(lease):
        with shielded(lease):
            assert lease.interrupter.interrupt(lambda: True) == "held"
        steps.append("inner block ended")
    assert steps == ["inner block ended"] and lease.interrupter.shield_depth == 0


def test_an_interrupt_sent_before_the_body_ended_is_withdrawn() -> None:
    blocked = threading.Lock()
    blocked.acquire()

    def blocked_in_a_call(lease: OwnedLease, go: threading.Event) -> None:
        with blocked:  # a C call: the asynchronous exception waits for it to return
            pass

    body = Body(blocked_in_a_call)
    lease = body.begin()
    interrupt(lease)
    assert lease.interrupter.sent
    end_of_body(lease)  # what the body's thread does after its last line (here, for it)
    blocked.release()
    assert body.end() == "returned"
    assert interrupt(lease) is None and lease.body_done  # a finished body is left alone


def test_a_thread_that_is_gone_is_not_interrupted(caplog: pytest.LogCaptureFixture) -> None:
    ended = threading.Thread(target=lambda: None)
    ended.start()
    ended.join()
    lease = lost_lease(ended.ident or 0)
    with caplog.at_level(logging.WARNING, logger=interrupts.logger.name):
        interrupt(lease)
    assert "its thread is gone" in caplog.text and not lease.interrupter.sent


@pytest.fixture
def prefork(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    previous = signal.getsignal(signal.SIGUSR1)
    monkeypatch.setattr(WORKER_PROCESS, "pool_kind", "prefork")
    monkeypatch.setattr(WORKER_PROCESS, "interrupt_handler_installed", False)
    yield
    signal.signal(signal.SIGUSR1, previous)


def test_prefork_sends_sigusr1_whose_handler_raises_the_interrupt_in_the_main_thread(prefork: None) -> None:
    others: list[int] = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: others.append(signum))  # billiard's, say
    install_interrupt_handler()
    lease = lost_lease(threading.main_thread().ident or 0)
    with pytest.raises(LeaseInterrupted, match="taken over"):
        interrupt(lease)
        for _ in range(1000):  # the handler runs at the next bytecode boundaries
            pass
    signal.raise_signal(signal.SIGUSR1)  # not ours: the previous handler gets it
    assert others == [signal.SIGUSR1]


def test_prefork_holds_the_signal_during_a_shield(prefork: None) -> None:
    install_interrupt_handler()
    lease = lost_lease(threading.main_thread().ident or 0)
    with pytest.raises(LeaseInterrupted), shielded(lease):
        lease.interrupter.shield_depth += 0  # the block: the signal lands here and waits
        WORKER_PROCESS.interrupting = lease
        signal.raise_signal(signal.SIGUSR1)
        assert lease.interrupter.pending
    assert not lease.interrupter.pending


# -- the gevent pool: thrown into the body's greenlet by the hub --------------------------------


def greenlet_body(run_body: Callable[[OwnedLease], None]) -> tuple[OwnedLease, list[str], object]:
    """A body in a greenlet of its own (real gevent, no monkey patching: it waits in gevent's
    own calls): its lease once it runs, and where its outcome will be recorded."""
    gevent = pytest.importorskip("gevent")
    outcome: list[str] = []
    leases: list[OwnedLease] = []

    def run() -> None:
        lease = lost_lease(threading.get_ident())
        lease.interrupter.runner = gevent.getcurrent()
        leases.append(lease)
        try:
            run_body(lease)
            outcome.append("returned")
        except LeaseInterrupted as exc:
            outcome.append(f"interrupted: {exc.reason}")

    runner = gevent.spawn(run)
    gevent.sleep(0)  # the body runs up to its first wait
    return leases[0], outcome, runner


def test_a_greenlet_parked_in_a_wait_is_interrupted_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WORKER_PROCESS, "pool_kind", "gevent")
    import gevent

    cleaned_up: list[str] = []

    def waits_for_ever(lease: OwnedLease) -> None:
        try:
            gevent.sleep(60)  # parked in the hub, as a socket read with no timeout is
        finally:
            cleaned_up.append("finally")

    lease, outcome, runner = greenlet_body(waits_for_ever)
    interrupt(lease)
    runner.join(5)  # type: ignore[attr-defined]
    assert outcome == ["interrupted: taken over"]
    assert cleaned_up == ["finally"]
    assert lease.interrupter.sent is False  # landed


def test_a_greenlet_interrupt_withdrawn_before_the_hub_runs_it_never_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WORKER_PROCESS, "pool_kind", "gevent")
    import gevent

    def ends_its_body_then_waits_in_celerys_code(lease: OwnedLease) -> None:
        gevent.sleep(0.1)  # parked where the interrupt would land

    lease, outcome, runner = greenlet_body(ends_its_body_then_waits_in_celerys_code)
    interrupt(lease)  # scheduled in the hub, which has not run since
    assert lease.interrupter.sent
    end_of_body(lease)  # the body ended first (its greenlet resumed before the hub's callback)
    runner.join(5)  # type: ignore[attr-defined]
    assert outcome == ["returned"]


def test_a_shielded_greenlet_gets_the_interrupt_when_its_block_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WORKER_PROCESS, "pool_kind", "gevent")
    import gevent

    reached: list[str] = []

    def shielded_wait(lease: OwnedLease) -> None:
        with shielded(lease):
            gevent.sleep(0.2)
            reached.append("block finished")
        reached.append("after the block")

    lease, outcome, runner = greenlet_body(shielded_wait)
    interrupt(lease)
    runner.join(5)  # type: ignore[attr-defined]
    assert reached == ["block finished"]
    assert outcome == ["interrupted: taken over"]


def test_only_the_greenlets_module_imports_gevent_and_only_inside_its_functions() -> None:
    import ast
    from pathlib import Path

    import celery_fenced

    found = []
    for path in Path(celery_fenced.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        top_level = set(tree.body)
        for node in ast.walk(tree):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(name.split(".")[0] == "gevent" for name in names):
                found.append((path.name, node in top_level))
    assert found and {name for name, _ in found} == {"greenlets.py"}, found
    assert not any(at_top for _, at_top in found), "gevent imported when the module is, not on the gevent pool"
