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
