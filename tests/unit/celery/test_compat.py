"""``celery_fenced._celery.compat`` is the one module that names a private or version-specific name of
Celery, kombu, redis-py or Python; its shims behave as the newest versions do."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from celery import Celery

import celery_fenced
from celery_fenced._celery import compat

PACKAGE = Path(celery_fenced.__file__).parent

#: Private-looking names that are documented API, each with where.
DOCUMENTED = {
    "_default_manager": "Django's Model._default_manager (documented in Django's model reference)",
    "_state": "Django's Model._state (documented: adding, db)",
    "_value2member_map_": "Python's enum lookup table, the same on 3.10 to 3.13",
}

#: Names that exist only in some supported version: used through compat alone.
VERSION_SPECIFIC = {
    r"\bfrom enum import\b.*\bStrEnum\b": "enum.StrEnum (Python 3.11+)",
    r"\bfrom datetime import\b.*\bUTC\b|\bdatetime\.UTC\b": "datetime.UTC (Python 3.11+)",
    r"\bweakref_slot\b": "dataclass(weakref_slot=...) (Python 3.11+)",
    r"\.is_connected\b": "redis-py Connection.is_connected (8.0+)",
    r"\bfrom celery\S* import\b.*\bget_actual_ignore_result\b": "get_actual_ignore_result (Celery 5.6+, moved in 5.7)",
    r"\.failure_expires\b": "RedisBackend.failure_expires (Celery 5.7+)",
    r"\._fail_chain\b": "BaseBackend._fail_chain (Celery 5.7+)",
}


def package_sources() -> dict[str, str]:
    """Every module of the package but compat, by dotted name: its source."""
    found = {}
    for info in pkgutil.walk_packages(celery_fenced.__path__, "celery_fenced."):
        module = importlib.import_module(info.name)
        path = Path(inspect.getfile(module))
        if info.name != "celery_fenced._celery.compat" and path.suffix == ".py":
            found[info.name] = path.read_text()
    found["celery_fenced"] = (PACKAGE / "__init__.py").read_text()
    return found


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_private_names(sources: dict[str, str]) -> set[str]:
    """The private names the package defines itself: functions, classes, assigned names and attributes."""
    names: set[str] = set()
    for source in sources.values():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                names.add(node.asname)
    return {name for name in names if is_private(name)}


def test_no_module_but_compat_imports_a_private_library_name() -> None:
    found = []
    for module, source in package_sources().items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if any(is_private(part) for part in node.module.split(".")):
                    found.append(f"{module}: from {node.module} import …")
                found += [
                    f"{module}: {alias.name} from {node.module}" for alias in node.names if is_private(alias.name)
                ]
            elif isinstance(node, ast.Import):
                found += [f"{module}: import {alias.name}" for alias in node.names if "._" in alias.name]
    assert not found, found


def test_no_module_but_compat_reads_a_private_attribute_it_does_not_define() -> None:
    sources = package_sources()
    own = own_private_names(sources)
    found = []
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in own | DOCUMENTED.keys():
                found.append(f"{module}:{node.lineno}: .{node.attr}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr")
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and is_private(node.args[1].value)
                and node.args[1].value not in own
            ):
                found.append(f"{module}:{node.lineno}: {node.func.id}(…, {node.args[1].value!r})")
    assert not found, found


def test_no_class_but_compat_overrides_a_private_library_method() -> None:
    found = []
    for module, source in package_sources().items():
        for node in ast.parse(source).body:
            if not isinstance(node, ast.ClassDef):
                continue
            cls = getattr(importlib.import_module(module), node.name)
            outside = [base for base in cls.__mro__[1:] if not base.__module__.startswith("celery_fenced")]
            for item in node.body:
                method = isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and is_private(item.name)
                if method and any(item.name in vars(base) for base in outside):
                    found.append(f"{module}.{node.name}.{item.name}")
    assert not found, found


@pytest.mark.parametrize("pattern", VERSION_SPECIFIC)
def test_version_specific_names_are_used_through_compat_only(pattern: str) -> None:
    found = [
        f"{module}:{number}"
        for module, source in package_sources().items()
        for number, line in enumerate(source.splitlines(), 1)
        if re.search(pattern, line) and not line.lstrip().startswith("#")
    ]
    assert not found, f"{VERSION_SPECIFIC[pattern]} used outside compat: {found}"


def test_every_shim_says_which_version_needs_it() -> None:
    source = (PACKAGE / "_celery" / "compat.py").read_text()
    shims = [node for node in ast.parse(source).body if isinstance(node, ast.If)]
    assert shims, "the version switches of compat.py"
    lines = source.splitlines()
    for node in shims:
        said = "\n".join(lines[node.lineno - 3 : node.end_lineno])
        assert re.search(r"(Python 3\.1\d|Celery 5\.\d|redis-py \d)", said), said


# -- the shims behave as the newest versions do -------------------------------------------------


class Colour(compat.StrEnum):
    RED = "red"


def test_str_enum_prints_formats_and_compares_as_its_value() -> None:
    assert str(Colour.RED) == f"{Colour.RED}" == "red" == Colour.RED
    assert f"{Colour.RED:>5}" == "  red"
    assert Colour("red") is Colour.RED
    assert isinstance(Colour.RED, str)


def test_utc_is_the_utc_timezone() -> None:
    assert compat.UTC is timezone.utc
    assert datetime(2026, 1, 1, tzinfo=compat.UTC).utcoffset().total_seconds() == 0


def test_weakref_slot_gives_a_slotted_dataclass_weak_references() -> None:
    import weakref
    from dataclasses import dataclass

    @dataclass(slots=True)
    class Slotted(compat.WeakrefSlot):
        value: int

    item = Slotted(1)
    assert weakref.ref(item)() is item
    assert not hasattr(item, "__dict__")


def test_ignore_result_follows_the_request_then_the_task() -> None:
    from celery.app.task import Context

    app = Celery("compat-ignore", set_as_current=False)

    @app.task(ignore_result=True)
    def ignored() -> None: ...

    @app.task
    def kept() -> None: ...

    assert compat.get_actual_ignore_result(ignored, None)
    assert not compat.get_actual_ignore_result(kept, None)
    assert compat.get_actual_ignore_result(kept, Context(ignore_result=True))
    assert not compat.get_actual_ignore_result(kept, Context())


def test_the_context_hook_request_is_made_only_when_asked_for() -> None:
    """A process that only sends tasks does not import the worker's Request through compat."""
    import subprocess

    code = (
        "import sys, celery_fenced._celery.compat as c; assert 'celery.worker.request' not in sys.modules; "
        "cls = c.ContextHookRequest; assert 'celery.worker.request' in sys.modules; "
        "assert cls is c.ContextHookRequest; print(cls.__module__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "celery_fenced._celery.compat"
    with pytest.raises(AttributeError, match="no attribute 'Missing'"):
        compat.Missing  # noqa: B018


def test_a_lost_process_is_told_as_celerys_on_failure_tells_it() -> None:
    from billiard.einfo import ExceptionWithTraceback
    from celery.exceptions import WorkerLostError
    from celery.worker.request import Request

    request = Request.__new__(Request)  # Celery's own defaults: neither cancelled nor revoked
    lost = WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 0.")
    assert compat.is_process_lost(request, lost)
    assert compat.is_process_lost(request, ExceptionWithTraceback(lost, "tb"))
    assert compat.is_process_lost(request, SystemExit(1))  # billiard >= 4.3 reports the exit itself
    assert not compat.is_process_lost(request, ValueError("the body's own failure"))
    request._already_revoked = True  # the request's own revoke stopped the process
    assert not compat.is_process_lost(request, SystemExit(1))
    assert compat.is_process_lost(request, lost)
