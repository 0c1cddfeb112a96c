"""Per-process state: one fork handler, none outside a worker, nothing keyed by ``id()``, and no
module-level state but what must be global."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import pytest
from celery import Celery

from celery_fenced._telemetry import metrics
from celery_fenced._telemetry.process import TELEMETRY
from celery_fenced._worker.process import WORKER_PROCESS
from celery_fenced._worker.runtime import runtime_of, runtimes
from tests.support.processes import in_a_forked_child

PACKAGE = Path(__file__).resolve().parents[2] / "celery_fenced"


def _sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in PACKAGE.rglob("*.py")}


def test_the_package_has_one_fork_handler_in_the_worker_runtime() -> None:
    found = {name: text.count("register_at_fork(") for name, text in _sources().items() if "register_at_fork(" in text}
    assert found == {"_worker/runtime.py": 1}


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
            "worker_modules": sorted(m for m in sys.modules if m.startswith("celery_fenced._worker")),
            "fork_handlers": [c for c in registered if c.startswith("celery_fenced")],
        }))
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"worker_modules": [], "fork_handlers": []}


class _Unflushed(metrics.MetricsBuffer):
    """A buffer that a heartbeat thread left by another test cannot empty meanwhile."""

    def flush(self, store: object) -> None:
        return None


def test_a_forked_child_starts_without_its_parents_runtime_metrics_and_interrupt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(TELEMETRY, "metrics", _Unflushed())
    monkeypatch.setattr(WORKER_PROCESS, "pool_kind", "prefork")
    monkeypatch.setattr(WORKER_PROCESS, "interrupting", object())  # a SIGUSR1 of the parent's under way
    app = Celery("forks", set_as_current=False)
    parent = runtime_of(app)
    assert parent is not None and runtime_of(app) is parent and parent in runtimes()
    TELEMETRY.metrics.inc("owner_lease_renew_total")
    try:
        seen = in_a_forked_child(
            lambda: {
                "runtime": runtime_of(app, create=False) is None,
                "runtimes": len(runtimes()),
                "metrics": TELEMETRY.metrics.take(),
                "id": WORKER_PROCESS.attempt_ids.next_id().split("/")[0],
                "interrupting": WORKER_PROCESS.interrupting is None,
                "pool": WORKER_PROCESS.pool_kind,
            }
        )
        assert seen == {
            "runtime": True,
            "runtimes": 0,
            "metrics": {},
            "id": seen["id"],
            "interrupting": True,  # the parent's interrupt is not the child's
            "pool": "prefork",  # inherited: a prefork child runs on the parent's pool
        }
        assert seen["id"] != str(os.getpid())  # the child's attempt ids carry its own pid
        assert runtime_of(app, create=False) is parent  # the parent keeps its own
        assert TELEMETRY.metrics.take() == {"owner_lease_renew_total|": 1}
    finally:
        parent.stop()


def test_attempt_ids_never_repeat_across_a_fork() -> None:
    before = WORKER_PROCESS.attempt_ids.next_id()
    seen = in_a_forked_child(lambda: {"id": WORKER_PROCESS.attempt_ids.next_id()})
    after = WORKER_PROCESS.attempt_ids.next_id()
    assert len({before, seen["id"], after}) == 3
    assert before.split("/")[0] == after.split("/")[0] == str(os.getpid())


# Module-level state the package may hold, each with why it must be global. Everything else a
# process keeps is in its one per-process object: the telemetry's (TELEMETRY) or, in a worker,
# the worker's (WORKER_PROCESS), both renewed in a fork by the worker's fork handler.
ALLOWED_MODULE_STATE = {
    "_telemetry/process.py:TELEMETRY": "the process's telemetry: metrics and events, in every process",
    "_worker/process.py:WORKER_PROCESS": "the worker state of the process: its pool, attempt ids, interrupt",
    "_celery/apps.py:_records": "the per-app records, weak: an app cannot carry them itself",
    "_celery/apps.py:_lock": "guards those records, whatever thread asks first",
    "_task/running.py:thread_state": "the thread's current lease: a thread-local read on the progress path",
    "_task/owner.py:_stage": "a bounded memo of normalised stage names: the same in every process",
    "_telemetry/metrics.py:_series_names": "a bounded memo of series names: the same in every process",
    "_telemetry/metrics.py:_stage_series": "a bounded memo of stage series names: the same in every process",
    "_worker/fork_guard.py:FORK_GUARD": "what a fork waits for: os.register_at_fork is process-wide",
    "_backend/backend.py:_LIVE_BACKENDS": "the backends whose subscriptions are left at exit: atexit is process-wide",
    "_backend/backend.py:_exit_hook": "the atexit hook is registered once per process",
    "_celery/startup.py:_warned": "a settings warning is said once per process, whatever the app",
    "_celery/startup.py:_pending": "warnings waiting for the process's logging, which is set up once",
    "_worker/listener.py:_unknown_stages": "an unknown stage is warned about once per process",
    "signals.py:lease_acquired": "a Celery Signal: a registry of receivers, global by design",
    "signals.py:progress_stalled": "a Celery Signal: a registry of receivers, global by design",
    "signals.py:lease_lost": "a Celery Signal: a registry of receivers, global by design",
    "signals.py:task_taken_over": "a Celery Signal: a registry of receivers, global by design",
    "signals.py:stale_write_rejected": "a Celery Signal: a registry of receivers, global by design",
}

# The ``global`` statements allowed, each with why.
ALLOWED_GLOBAL_STATEMENTS = {
    "_task/wiring.py:_hooks": "the worker side, loaded at a worker's first fenced task; read by every task's receivers",
    "_task/wiring.py:_lifecycle": "the worker side, loaded at the first attempt: a process that sends never loads it",
    "contrib/flower/__init__.py:_installed": "Flower's classes are patched once per process",
}

_MUTATORS = {"add", "append", "appendleft", "clear", "discard", "extend", "insert", "pop", "popitem", "remove"}
_MUTATORS |= {"setdefault", "update"}
_IMMUTABLE_CALLS = {"frozenset", "tuple", "MappingProxyType", "compile", "TypeVar", "ParamSpec", "object", "str", "int"}
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "deque", "OrderedDict", "Counter", "local", "Lock", "RLock"}
_MUTABLE_CALLS |= {"WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "Event", "Condition", "Semaphore"}
_DISPLAYS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(text) for name, text in _sources().items()}


def _mutated_names(trees: Iterable[ast.Module]) -> set[str]:
    """Names written through anywhere in the package: ``x[k] = …``, ``x.a = …``, ``x.add(…)``."""
    names: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.Delete):
                targets = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            names.update(
                t.value.id
                for t in targets
                if isinstance(t, ast.Subscript | ast.Attribute) and isinstance(t.value, ast.Name)
            )
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS
                and isinstance(node.func.value, ast.Name)
            ):
                names.add(node.func.value.id)
    return names


def _is_holder(name: str, value: ast.expr, mutated: set[str]) -> bool:
    """A module-level value that is state: a container or an object made by a call, unless an
    UPPER_CASE name (a constant) that nothing writes through."""
    constant = name.lstrip("_").isupper()
    if isinstance(value, _DISPLAYS):
        return not constant or name in mutated
    if isinstance(value, ast.Call):
        func = value.func
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if called in _MUTABLE_CALLS or name in mutated:
            return True
        return not constant and called not in _IMMUTABLE_CALLS and name != "logger"
    return False


def _module_state() -> tuple[set[str], set[str]]:
    """The package's module-level holders and the names of its ``global`` statements."""
    trees = _trees()
    mutated = _mutated_names(trees.values())
    holders: set[str] = set()
    globals_: set[str] = set()
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            holders.update(
                f"{module}:{t.id}"
                for t in targets
                if isinstance(t, ast.Name) and t.id != "__all__" and _is_holder(t.id, value, mutated)
            )
        globals_.update(
            f"{module}:{name}" for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names
        )
    return holders, globals_


def test_module_level_state_is_only_what_must_be_global() -> None:
    holders, globals_ = _module_state()
    assert {h for h in holders if h not in ALLOWED_MODULE_STATE} == set(), "per-process state: use the process's object"
    assert {g for g in globals_ if g not in ALLOWED_GLOBAL_STATEMENTS} == set(), "a new global statement"
    # The lists hold nothing that is gone (each entry still names a holder).
    assert set(ALLOWED_MODULE_STATE) == holders
    assert set(ALLOWED_GLOBAL_STATEMENTS) == globals_


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("_cache = {}\n", {"m.py:_cache"}),
        ("_seen: set[str] = set()\n", {"m.py:_seen"}),
        ("state = threading.local()\n", {"m.py:state"}),
        ("LOCK = threading.Lock()\n", {"m.py:LOCK"}),
        ("TABLE = {'a': 1}\ndef f():\n    TABLE['b'] = 2\n", {"m.py:TABLE"}),
        ("STATE = Holder()\ndef f():\n    STATE.x = 1\n", {"m.py:STATE"}),
        ("_n = 0\ndef f():\n    global _n\n    _n += 1\n", {"global m.py:_n"}),
        ("TABLE = {'a': 1}\nNAMES = ('a',)\nPATTERN = re.compile('a')\n_P = TypeVar('_P')\n", set()),
        ("logger = logging.getLogger('x')\n_clock = time.monotonic\n", set()),
    ],
)
def test_the_scan_finds_module_level_state(source: str, found: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "_sources", lambda: {"m.py": textwrap.dedent(source)})
    holders, globals_ = _module_state()
    assert holders | {f"global {g}" for g in globals_} == found
