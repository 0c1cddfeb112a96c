"""The gevent pool's side of the worker (_worker/greenlets.py): a process gevent did not patch is
refused in one message, and an interrupt for a greenlet that is gone is not sent.

This test process is not monkey-patched (and must not be): what a patched process does is run
in a process of its own. Throwing into a parked greenlet is tested with the interrupt
(tests/unit/worker/test_interrupt.py).
"""

from __future__ import annotations

import os
import textwrap

import pytest

from celery_fenced._task.owner import OwnedLease
from celery_fenced._worker import greenlets
from celery_fenced.conf import FencedConfig
from celery_fenced.exceptions import ConfigurationError
from tests.support.processes import run_project_python

gevent = pytest.importorskip("gevent")


def test_a_process_gevent_did_not_patch_is_refused_naming_every_module_left_unpatched() -> None:
    with pytest.raises(ConfigurationError) as refused:
        greenlets.check_patched()
    message = str(refused.value)
    assert greenlets.PATCHED_MODULES == ("socket", "select", "threading", "time")
    assert "and socket, select, threading, time are not patched" in message
    assert "celery -A proj worker -P gevent" in message and "gevent.monkey.patch_all()" in message


def _in_a_process_of_its_own(program: str) -> str:
    """The last line ``program`` prints, run by a fresh interpreter."""
    output = run_project_python(["-c", textwrap.dedent(program)], dict(os.environ), timeout=60)
    return output.strip().splitlines()[-1]


def test_a_process_gevent_patched_first_passes() -> None:
    program = """
        from gevent import monkey
        monkey.patch_all()
        from celery_fenced._worker.greenlets import check_patched
        check_patched()
        print("passed")
    """
    assert _in_a_process_of_its_own(program) == "passed"


def test_a_process_that_imported_the_package_before_gevent_patched_it_is_refused() -> None:
    program = """
        import warnings
        warnings.simplefilter("ignore")  # gevent warns of what was imported before it patched
        from celery_fenced._worker.greenlets import check_patched
        from gevent import monkey
        monkey.patch_all()
        try:
            check_patched()
        except Exception as exc:
            print(type(exc).__name__, exc)
        else:
            print("passed")
    """
    said = _in_a_process_of_its_own(program)
    assert said.startswith("ConfigurationError celery_fenced was imported before gevent patched threading"), said


def test_current_is_the_greenlet_running_the_caller() -> None:
    seen: list[object] = []
    runner = gevent.spawn(lambda: seen.append(greenlets.current()))
    runner.join(timeout=5)
    assert seen == [runner]
    assert greenlets.current() is gevent.getcurrent()


def test_an_interrupt_for_a_greenlet_that_is_gone_is_not_sent(caplog: pytest.LogCaptureFixture) -> None:
    lease = OwnedLease("t1", "proj.task", "host/1/a", 7, 1, 0, FencedConfig.from_mapping({}).policy)
    runner = gevent.spawn(lambda: None)
    runner.join(timeout=5)
    assert runner.dead
    with caplog.at_level("WARNING", logger=greenlets.logger.name):
        sent = greenlets.throw_later(lease, runner, RuntimeError("interrupted"))
    assert sent is False
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("celery_fenced.worker.greenlets", "WARNING", "task proj.task[t1]: its greenlet is gone, nothing to interrupt")
    ]
