"""Per-process state: one fork handler, none outside a worker, nothing keyed by ``id()``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from celery import Celery

from celery_fenced import metrics
from celery_fenced.calls import next_attempt_id
from celery_fenced.names import NameMemo
from celery_fenced.worker.runtime import runtime_of, runtimes

PACKAGE = Path(__file__).resolve().parents[2] / "celery_fenced"


def _sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in PACKAGE.rglob("*.py")}


def test_the_package_has_one_fork_handler_in_the_worker_runtime() -> None:
    found = {name: text.count("register_at_fork(") for name, text in _sources().items() if "register_at_fork(" in text}
    assert found == {"worker/runtime.py": 1}


def test_no_state_is_keyed_by_an_objects_id() -> None:
    # id() is reused once its object is gone: a cache keyed by it hands a new object an old entry.
    found = [name for name, text in _sources().items() if re.search(r"(?<![\w.])id\(", text)]
    assert found == []


def test_a_process_that_sends_tasks_loads_no_worker_module_and_registers_no_fork_handler() -> None:
    program = textwrap.dedent(
        """
        import json, os, sys, traceback

        registered = []
        real = os.register_at_fork

        def recording(**hooks):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            registered.append(caller)
            return real(**hooks)

        os.register_at_fork = recording

        import celery_fenced
        from celery import Celery
        from celery_fenced import ProgressLeasedTask

        app = Celery("web", broker="memory://", result_backend="fenced+redis://127.0.0.1:1/0")

        @app.task(bind=True, base=ProgressLeasedTask)
        def report(self, n):
            self.progress("LOAD_DATA", n=n)
            return n

        app.finalize()
        assert report.apply(args=(3,)).get() == 3  # eager: runs without a lease
        print(json.dumps({
            "worker_modules": sorted(m for m in sys.modules if m.startswith("celery_fenced.worker")),
            "fork_handlers": [c for c in registered if c.startswith("celery_fenced")],
        }))
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"worker_modules": [], "fork_handlers": []}


def _in_a_forked_child(check: Callable[[], dict[str, object]]) -> dict[str, object]:
    """Fork; the child runs ``check`` and sends its JSON back."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, running nothing of pytest's
        try:
            os.write(write, json.dumps(check()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    result: dict[str, object] = json.loads(answer)
    return result


class _Unflushed(metrics.MetricsBuffer):
    """A buffer that a heartbeat thread left by another test cannot empty meanwhile."""

    def flush(self, store: object) -> None:
        return None


def test_a_forked_child_starts_without_its_parents_runtime_and_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics, "buffer", _Unflushed())
    app = Celery("forks", set_as_current=False)
    parent = runtime_of(app)
    assert parent is not None and runtime_of(app) is parent and parent in runtimes()
    metrics.buffer.inc("owner_lease_renew_total")
    try:
        seen = _in_a_forked_child(
            lambda: {
                "runtime": runtime_of(app, create=False) is None,
                "runtimes": len(runtimes()),
                "metrics": metrics.buffer.take(),
                "id": next_attempt_id().split("/")[0],
            }
        )
        assert seen == {"runtime": True, "runtimes": 0, "metrics": {}, "id": seen["id"]}
        assert seen["id"] != str(os.getpid())  # the child's attempt ids carry its own pid
        assert runtime_of(app, create=False) is parent  # the parent keeps its own
        assert metrics.buffer.take() == {"owner_lease_renew_total|": 1}
    finally:
        parent.stop()


def test_attempt_ids_never_repeat_across_a_fork() -> None:
    before = next_attempt_id()
    seen = _in_a_forked_child(lambda: {"id": next_attempt_id()})
    after = next_attempt_id()
    assert len({before, seen["id"], after}) == 3
    assert before.split("/")[0] == after.split("/")[0] == str(os.getpid())


def test_a_name_memo_remembers_a_bounded_number_of_names() -> None:
    made: list[str] = []

    def make(name: str) -> str:
        made.append(name)
        return name.upper()

    memo = NameMemo(make, limit=2)
    assert [memo(n) for n in ("a", "b", "a", "c", "c")] == ["A", "B", "A", "C", "C"]
    assert made == ["a", "b", "c", "c"]  # "c" came after the limit: made each time, never kept
    assert len(memo.made) == 2
