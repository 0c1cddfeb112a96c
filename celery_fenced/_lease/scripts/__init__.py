"""The Lua scripts that make every change to the shared state, and their loader.

Each script lives in its own ``<name>.lua`` file beside this module, headed by its KEYS,
ARGV and return codes. The functions several scripts share (the server clock, Celery's
result write) live once, in ``_lib.lua``; the loader puts in front of each script the ones it
calls. :mod:`celery_fenced._lease.gateway` runs them.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

__all__ = ["SCRIPT_NAMES", "script_header", "script_source"]

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


_FUNCTION = re.compile(r"^local function (\w+)\(", re.MULTILINE)


@cache
def _library() -> dict[str, str]:
    """The functions of ``_lib.lua`` by name, each with its source, in the file's order."""
    text = _read(_LIBRARY)
    starts = list(_FUNCTION.finditer(text))
    ends = [match.start() for match in starts[1:]] + [len(text)]
    return {match.group(1): text[match.start() : end].rstrip() + "\n" for match, end in zip(starts, ends, strict=True)}


def _calls(source: str, name: str) -> bool:
    return re.search(rf"\b{name}\(", source) is not None


@cache
def script_source(name: str) -> str:
    """The Lua source run for a script: the functions of the shared library it calls (and
    those they call), then ``<name>.lua``.

    Every function defined costs each run of the script a closure, called or not.
    """
    body = script_header(name)
    library = _library()
    needed = {fn for fn in library if _calls(body, fn)}
    while True:  # what the needed functions call in turn
        more = {fn for fn in library if fn not in needed and any(_calls(library[n], fn) for n in needed)}
        if not more:
            break
        needed |= more
    used = "".join(source for fn, source in library.items() if fn in needed)
    return f"{used}\n{body}"
