"""Every module says what it offers: ``__all__`` is sorted, names only what exists, and misses nothing."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import pytest

import celery_fenced


def modules() -> list[str]:
    found = ["celery_fenced"]
    for info in pkgutil.walk_packages(celery_fenced.__path__, "celery_fenced."):
        if ".scripts" not in info.name:
            found.append(info.name)
    return sorted(found)


def sort_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps: CONSTANTS, then Classes, then functions."""
    if name.isupper() or (name.upper() == name and "_" in name):
        return 0, name
    return (1 if name[0].isupper() else 2), name


def defined_here(module: ModuleType) -> set[str]:
    """The public functions and classes defined in ``module``, and its public UPPER_CASE constants."""
    names = set()
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, TypeVar):
            continue
        if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__:
            names.add(name)
    source = Path(inspect.getfile(module)).read_text()
    for node in ast.parse(source).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            constant = isinstance(target, ast.Name) and target.id.isupper() and not target.id.startswith("_")
            if constant and not isinstance(vars(module).get(target.id), TypeVar):
                names.add(target.id)
    return names


@pytest.mark.parametrize("name", modules())
def test_all_is_sorted_existing_and_complete(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    if exported is None:
        assert not defined_here(module), f"{name} defines public names but has no __all__"
        return
    assert list(exported) == sorted(exported, key=sort_key), f"{name}.__all__ is not sorted"
    assert len(set(exported)) == len(exported), f"{name}.__all__ names something twice"
    missing = [item for item in exported if not hasattr(module, item)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"
    unlisted = sorted(defined_here(module) - set(exported))
    assert not unlisted, f"{name} defines public names missing from __all__: {unlisted}"


#: The package's public modules: everything else is in a private folder (``_lease``, ``_worker``…).
PUBLIC_MODULES = {
    "celery_fenced",
    "celery_fenced.backend",
    "celery_fenced.conf",
    "celery_fenced.contrib",
    "celery_fenced.contrib.django",
    "celery_fenced.contrib.django.apps",
    "celery_fenced.contrib.django.checks",
    "celery_fenced.contrib.django.models",
    "celery_fenced.contrib.flower",
    "celery_fenced.contrib.flower.flowerconfig",
    "celery_fenced.exceptions",
    "celery_fenced.fencing",
    "celery_fenced.harness",
    "celery_fenced.metrics",
    "celery_fenced.signals",
    "celery_fenced.state",
    "celery_fenced.task",
    "celery_fenced.testing",
    "celery_fenced.worker",
    "celery_fenced.worker.request",
}


def test_every_module_outside_a_private_folder_is_a_public_one() -> None:
    public = {name for name in modules() if not any(part.startswith("_") for part in name.split("."))}
    assert public == PUBLIC_MODULES


def test_the_public_names_are_the_package_s_own_and_the_kept_paths_name_the_same_objects() -> None:
    for name in celery_fenced.__all__:
        value = getattr(celery_fenced, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            # A stored result names an exception by its module: the one earlier versions stored.
            assert value.__module__ == "celery_fenced.exceptions", name
        else:
            assert value.__module__ == "celery_fenced", name
    for path, names in {
        "celery_fenced.backend": ["FencedRedisBackend"],
        "celery_fenced.task": ["ProgressLeasedTask", "StageBlock"],
        "celery_fenced.state": ["Checkpoint", "LeaseState"],
    }.items():
        module = importlib.import_module(path)
        for name in names:
            assert getattr(module, name) is getattr(celery_fenced, name), f"{path}.{name}"


#: The kept import paths (re-export modules, tested here and nowhere else), each with the private
#: module whose names it re-exports.
KEPT_PATHS = {
    "celery_fenced.backend": "celery_fenced._backend.backend",
    "celery_fenced.metrics": "celery_fenced._telemetry.metrics",
    "celery_fenced.state": "celery_fenced._lease.state",
    "celery_fenced.task": "celery_fenced._task.task",
    "celery_fenced.worker.request": "celery_fenced._worker.request",
}


@pytest.mark.parametrize(("path", "private"), sorted(KEPT_PATHS.items()))
def test_a_kept_path_names_the_objects_of_its_private_module(path: str, private: str) -> None:
    kept, defined = importlib.import_module(path), importlib.import_module(private)
    assert kept.__all__, f"{path} re-exports nothing"
    for name in kept.__all__:
        assert getattr(kept, name) is getattr(defined, name), f"{path}.{name}"
