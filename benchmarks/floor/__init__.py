"""The floor: what any design that runs a script before a task's body and one for its result
costs, at least.

``acquire.lua`` and ``store.lua`` here take the package's KEYS and ARGV and do only what
cannot be left out: take a token, and write Celery's result. :func:`use_floor_scripts` makes
every lease store built after it in this process run them instead of the package's. The
benchmarks run a fenced worker with them (``throughput.py --floor``, ``script_cost.py``) to
show, on the same server in the same run, how much of what a fenced task costs Redis is the
price of the two script calls themselves, and how much is the lease's work.

The floor keeps no lease: it fences nothing, and is never a way to run tasks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from celery_fenced._lease import scripts

__all__ = ["FLOOR_SCRIPTS", "floor_scripts", "use_floor_scripts"]

#: The package's scripts the floor replaces.
FLOOR_SCRIPTS = ("acquire", "store")

_HERE = Path(__file__).resolve().parent
_package_source = scripts.script_source


def _floor_source(name: str) -> str:
    if name in FLOOR_SCRIPTS:
        return (_HERE / f"{name}.lua").read_text()
    return _package_source(name)


def use_floor_scripts() -> None:
    """Build every lease store of this process from here on with the floor's two scripts."""
    scripts.script_source = _floor_source  # type: ignore[assignment]


@contextlib.contextmanager
def floor_scripts() -> Iterator[None]:
    """The floor's two scripts for the lease stores built inside the block."""
    use_floor_scripts()
    try:
        yield
    finally:
        scripts.script_source = _package_source
