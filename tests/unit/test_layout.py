"""The package's layout: the map that opens docs/design.rst names each part's folder and modules
as the tree has them, the imports between modules go one way (no circle, and no part imports a
part on a higher layer of the map), and the unit tests mirror the package's folders."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_fenced"
DESIGN = ROOT / "docs" / "design.rst"

#: The one door up: the task side reaches the worker side only through ``_task/wiring.py``, only
#: lazily (inside a function) or by name, as Celery loads a worker's bootsteps and a task's
#: request class by name; the worker side is so loaded only in a worker
#: (tests/unit/test_process_state.py runs a process that sends and runs tasks eagerly, and loads
#: none of it).
DOOR = ("celery_fenced._task.wiring", "celery_fenced._worker.")

#: Imports that still go up the map (or close a circle), each with why it is still there. A new
#: one fails the test; so does one that is gone but still listed here.
KNOWN: dict[tuple[str, str], str] = {}

#: The modules with no test module of their own where the unit tests mirror the package
#: (:func:`mirror_of`), each with the test module that covers it and why it is tested there.
#: A module that gains its own test module fails the test until it is taken out of here.
TESTED_ELSEWHERE: dict[str, tuple[str, str]] = {
    # Kept import paths: re-exports only, each checked against its private module.
    "celery_fenced.backend": ("tests/unit/test_public_api.py", "a kept import path: re-exports _backend.backend"),
    "celery_fenced.metrics": ("tests/unit/test_public_api.py", "a kept import path: re-exports _telemetry.metrics"),
    "celery_fenced.state": ("tests/unit/test_public_api.py", "a kept import path: re-exports _lease.state"),
    "celery_fenced.task": ("tests/unit/test_public_api.py", "a kept import path: re-exports _task.task"),
    "celery_fenced.worker.request": (
        "tests/unit/test_public_api.py",
        "a kept import path: re-exports _worker.request (whose tests are tests/unit/worker/test_request.py)",
    ),
    # Constants and declarations only: tested where they are set, sent and read.
    "celery_fenced._celery.headers": (
        "tests/unit/task/test_calls.py",
        "constants only: the message headers, set and read in the tests of the calls (and of the reaper)",
    ),
    "celery_fenced.signals": (
        "tests/plugin/test_fixtures.py",
        "declarations only: Celery Signals, each heard with its arguments from a real worker there",
    ),
    # One module, one test module per script.
    "celery_fenced._lease.store": (
        "tests/unit/lease/test_acquire.py",
        "the lease store runs one script per change: tested per script, tests/unit/lease/test_<script>.py",
    ),
    # A part of an integration, tested through it.
    "celery_fenced.contrib.flower._attempts": (
        "tests/unit/contrib/test_flower.py",
        "the attempt history of the Flower integration: fed through Flower's real event State, as install() wires it",
    ),
    # Tests that need what the unit tests do not have.
    "celery_fenced._operator.dashboards": (
        "tests/monitoring/test_rules.py",
        "its dashboard and rules are checked by Prometheus's own tools, with the monitoring tests",
    ),
    "celery_fenced.contrib.django.apps": (
        "tests/django/test_settings_checks.py",
        "Django contrib: tested in a configured Django project",
    ),
    "celery_fenced.contrib.django.checks": (
        "tests/django/test_settings_checks.py",
        "Django contrib: tested in a configured Django project",
    ),
    "celery_fenced.contrib.django.models": (
        "tests/django/test_fenced_writes.py",
        "Django contrib: tested in a configured Django project, on the test app's models",
    ),
    "celery_fenced.contrib.flower.flowerconfig": (
        "tests/integration/test_observability.py",
        "Flower's config file: run by Flower itself, as `celery fenced flower` starts it",
    ),
    # The test support the package ships, in use.
    "celery_fenced.harness": (
        "tests/plugin/test_binaries.py",
        "test support: every test's Redis is its RedisServer (tests/support/redis_server.py); the binary it picks",
    ),
    "celery_fenced.testing": ("tests/plugin/test_fixtures.py", "the pytest plugin: its fixtures and helpers in use"),
}


@dataclass(frozen=True)
class Part:
    """One row of the map: a part, its folder, its layer and the modules it owns."""

    name: str
    folder: str
    layer: int
    owns: tuple[str, ...]


def _columns(border: str) -> list[tuple[int, int]]:
    return [(match.start(), match.end()) for match in re.finditer(r"=+", border)]


def read_map() -> list[Part]:
    """The rows of the first table of docs/design.rst (the map), continuation lines joined."""
    lines = DESIGN.read_text().splitlines()
    borders = [i for i, line in enumerate(lines) if re.fullmatch(r"=+( +=+)+", line)]
    top, header, bottom = borders[:3]
    spans = _columns(lines[top])
    assert [lines[header - 1][a:b].strip() for a, b in spans[:3]] == ["part", "folder", "layer"]
    rows: list[list[str]] = []
    for line in lines[header + 1 : bottom]:
        cells = [line[a:b].strip() for a, b in spans[:-1]] + [line[spans[-1][0] :].strip()]
        if cells[0] or not rows:
            rows.append(cells)
        else:  # a continuation line: a blank first column
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells, strict=True)]
    return [
        Part(
            name=name,
            folder=folder.strip("`"),
            layer=int(layer),
            owns=tuple(re.findall(r"``([\w/]+(?:\.py|/))``", owns)),
        )
        for name, folder, layer, owns in rows
    ]


def module_of(path: Path) -> str:
    """The dotted name of the module in ``path``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_of(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def owners() -> dict[str, Part]:
    """Each module of the tree, with the part of the map that owns it."""
    owned: dict[str, Part] = {}
    for part in read_map():
        folder = ROOT / part.folder
        paths = [] if folder == PACKAGE else [folder / "__init__.py"]
        for name in part.owns:
            target = folder / name
            paths += sorted(target.rglob("*.py")) if name.endswith("/") else [target]
        for path in paths:
            module = module_of(path)
            assert module not in owned, f"{module} is in the map twice ({owned[module].name}, {part.name})"
            owned[module] = part
    return owned


@dataclass(frozen=True)
class Edge:
    """One module naming another: an import (lazy when inside a function) or a load by name."""

    source: str
    target: str
    line: int
    how: str  # "import", "lazy import" or "by name"


def _resolve(name: str) -> str | None:
    """The module of the package that ``name`` (a module, or a name in one) is, or is in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(source: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = source if MODULES[source].name == "__init__.py" else source.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    for alias in node.names:  # a submodule (from . import x) or a name in the module
        yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base


def edges_of(source: str) -> Iterator[Edge]:
    """Every module of the package that ``source`` imports (at its top, in a function, under
    TYPE_CHECKING) or names for Celery to load (``"celery_fenced._x.y"``, ``"…:Class"``)."""
    tree = ast.parse(MODULES[source].read_text())
    lazy: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lazy |= {id(inner) for inner in ast.walk(node) if inner is not node}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            how = "lazy import" if id(node) in lazy else "import"
            for name in _targets(source, node):
                target = _resolve(name) if name.startswith("celery_fenced") else None
                if target is not None and target != source:
                    yield Edge(source, target, node.lineno, how)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = re.fullmatch(r"(celery_fenced\._[\w.]+)(?::\w+)?", node.value)
            if named and named.group(1) in MODULES:
                yield Edge(source, named.group(1), node.lineno, "by name")


EDGES = [edge for source in MODULES for edge in edges_of(source)]


def _is_door(edge: Edge) -> bool:
    return edge.source == DOOR[0] and edge.target.startswith(DOOR[1]) and edge.how != "import"


# -- the map matches the tree ---------------------------------------------------------------------


def test_the_map_names_every_module_of_the_tree_once() -> None:
    assert sorted(set(MODULES) - set(owners())) == []


def test_the_map_names_nothing_the_tree_lacks() -> None:
    for part in read_map():
        folder = ROOT / part.folder
        assert folder.is_dir(), f"{part.name}: no folder {part.folder}"
        missing = [name for name in part.owns if not (folder / name).exists()]
        assert missing == [], f"{part.name}: {part.folder} has no {missing}"
    assert sorted(set(owners()) - set(MODULES)) == []


def test_every_folder_of_the_package_is_a_part_or_inside_one() -> None:
    folders = {path.parent for path in PACKAGE.rglob("__init__.py")} - {PACKAGE}
    named = {ROOT / part.folder for part in read_map()}
    named |= {ROOT / part.folder / name for part in read_map() for name in part.owns if name.endswith("/")}
    assert (
        sorted(str(folder.relative_to(ROOT)) for folder in folders if not (set(folder.parents) | {folder}) & named)
        == []
    )
    wings = {
        path.name
        for path in PACKAGE.iterdir()
        if path.is_dir() and path.name.startswith("_") and path.name != "__pycache__"
    }
    assert wings <= {Path(part.folder).name for part in read_map()}


# -- the imports go one way -------------------------------------------------------------------------


def upward_edges() -> set[tuple[str, str]]:
    """The edges from a part to a part on its layer or above it, but the door."""
    owner = owners()
    return {
        (edge.source, edge.target)
        for edge in EDGES
        if owner[edge.source] != owner[edge.target]
        and owner[edge.target].layer >= owner[edge.source].layer
        and not _is_door(edge)
    }


def test_no_part_imports_a_part_above_it_but_the_known_ones() -> None:
    found = upward_edges()
    assert sorted(found - set(KNOWN)) == [], "a new import up the map: import the other way, or go through a lower part"
    assert sorted(set(KNOWN) - found) == [], "gone: take it out of KNOWN"


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph``, as the modules around it, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph.get(node, ())):
            found = visit(target)
            if found:
                return found
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node)
        if found:
            return found
    return None


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph: dict[str, set[str]] = {}
    for edge in EDGES:
        if (edge.source, edge.target) not in KNOWN:
            graph.setdefault(edge.source, set()).add(edge.target)
    circle = _circle(graph)
    assert circle is None, "a circle: " + " -> ".join(circle or [])


def test_the_task_side_reaches_the_worker_side_only_through_the_door_and_only_lazily() -> None:
    owner = owners()
    reach = sorted(
        (edge.source, edge.target, edge.how)
        for edge in EDGES
        if owner[edge.source].folder.endswith("/_task/") and owner[edge.target].folder.endswith("/_worker/")
    )
    assert reach, "the door is gone: update DOOR"
    assert [edge for edge in reach if edge[0] != DOOR[0] or edge[2] == "import"] == []


# -- the scan sees what it must ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "target", "how"),
    [
        ("celery_fenced._telemetry.metrics", "celery_fenced._lease.store", "import"),  # under TYPE_CHECKING
        ("celery_fenced._task.wiring", "celery_fenced._worker.hooks", "lazy import"),  # in a function
        ("celery_fenced._task.wiring", "celery_fenced._worker.request", "by name"),
        ("celery_fenced._worker.hooks", "celery_fenced._worker.greenlets", None),  # gone to checks
        ("celery_fenced._worker.checks", "celery_fenced._worker.greenlets", "import"),  # from . import x
        ("celery_fenced._reaper.reaper", "celery_fenced.signals", "import"),  # from .. import x
        ("celery_fenced.contrib.flower.flowerconfig", "celery_fenced.contrib.flower", "import"),  # absolute
    ],
)
def test_the_scan_finds_every_kind_of_import(source: str, target: str, how: str | None) -> None:
    found = {edge.how for edge in EDGES if (edge.source, edge.target) == (source, target)}
    assert how in found if how else found == set()


def test_the_layers_are_read_from_the_map() -> None:
    layers = {Path(part.folder).name: part.layer for part in read_map() if part.folder != "celery_fenced/"}
    assert layers["_celery"] < layers["_lease"] < layers["_task"] < layers["_worker"] < layers["contrib"]


# -- the unit tests mirror the package --------------------------------------------------------------


def mirror_of(path: Path) -> Path:
    """The test module of the module in ``path``: ``celery_fenced/_folder/module.py`` is tested by
    ``tests/unit/folder/test_module.py``, a top-level module by ``tests/unit/test_module.py``."""
    relative = path.relative_to(PACKAGE)
    folders = [folder.removeprefix("_") for folder in relative.parts[:-1]]
    return ROOT.joinpath("tests", "unit", *folders, f"test_{relative.name}")


def test_every_module_has_its_test_module() -> None:
    modules = {module: path for module, path in MODULES.items() if path.name != "__init__.py"}
    mirrors = {module: mirror_of(path) for module, path in modules.items()}
    missing = sorted(
        f"{module}: {mirrors[module].relative_to(ROOT)}"
        for module in modules
        if module not in TESTED_ELSEWHERE and not mirrors[module].is_file()
    )
    assert missing == [], "write the test module, or say in TESTED_ELSEWHERE which tests cover it and why"
    assert sorted(set(TESTED_ELSEWHERE) - set(modules)) == [], "gone: take it out of TESTED_ELSEWHERE"
    for module, (test_path, reason) in TESTED_ELSEWHERE.items():
        assert (ROOT / test_path).is_file(), f"{module}: no {test_path}"
        assert test_path.startswith("tests/") and test_path.endswith(".py"), f"{module}: {test_path}"
        assert reason.strip() and "\n" not in reason, f"{module}: say why, in one line"
    # A module's mirror is its own, but a kept path's (worker/request.py) is also the mirror of the
    # private module it re-exports (_worker/request.py): that test module is the private module's.
    owned: dict[Path, str] = {}
    for module in sorted(set(modules) - set(TESTED_ELSEWHERE)):
        assert mirrors[module] not in owned, f"{module} and {owned[mirrors[module]]} mirror to one test module"
        owned[mirrors[module]] = module
    gained = sorted(module for module in TESTED_ELSEWHERE if mirrors[module].is_file() and mirrors[module] not in owned)
    assert gained == [], "it has a test module of its own now: take it out of TESTED_ELSEWHERE"


@pytest.mark.parametrize(
    ("module", "mirror"),
    [
        ("_worker/runtime.py", "tests/unit/worker/test_runtime.py"),
        ("_lease/store.py", "tests/unit/lease/test_store.py"),
        ("contrib/django/apps.py", "tests/unit/contrib/django/test_apps.py"),
        ("conf.py", "tests/unit/test_conf.py"),
    ],
)
def test_a_modules_mirror_drops_the_leading_underscore_of_each_folder(module: str, mirror: str) -> None:
    assert mirror_of(PACKAGE / module) == ROOT / mirror
