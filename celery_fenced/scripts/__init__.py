"""The Lua scripts that make every change to the shared state, and their loader.

Each script lives in its own ``<name>.lua`` file beside this module, headed by its KEYS,
ARGV and return codes. The functions several scripts share (the server clock, Celery's
result write) live once, in ``_lib.lua``, which the loader puts in front of each script.
:class:`ScriptSet` registers every script file with redis-py's ``register_script``, which
runs them by SHA and reloads a script after ``NoScriptError`` (a Redis restart).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

from redis.commands.core import Script

__all__ = ["SCRIPT_NAMES", "ScriptSet", "script_header", "script_source"]

_LIBRARY = "_lib"


def _names() -> tuple[str, ...]:
    files = resources.files(__package__)
    return tuple(
        sorted(
            entry.name.removesuffix(".lua")
            for entry in files.iterdir()
            if entry.name.endswith(".lua") and not entry.name.startswith("_")
        )
    )


#: Every script the package runs: one ``<name>.lua`` file each, found beside this module.
SCRIPT_NAMES = _names()


def _read(name: str) -> str:
    return resources.files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")


def script_header(name: str) -> str:
    """The script file itself, without the shared library (its header is its contract)."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"unknown lease script {name!r}")
    return _read(name)


@cache
def script_source(name: str) -> str:
    """The Lua source run for a script: the shared library, then ``<name>.lua``."""
    return f"{_read(_LIBRARY)}\n{script_header(name)}"


class ScriptSet:
    """The package's scripts registered on one Redis client, as attributes by name."""

    def __init__(self, client: Any) -> None:
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPT_NAMES}

    def __getattr__(self, name: str) -> Script:
        try:
            scripts: dict[str, Script] = self.__dict__["_scripts"]
            return scripts[name]
        except KeyError:
            raise AttributeError(f"no lease script {name!r}") from None
