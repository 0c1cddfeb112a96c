"""The Lua scripts that make every change to the shared state, and their loader.

Each script lives in its own ``.lua`` file beside this module, headed by its KEYS, ARGV and
return codes. :class:`ScriptSet` registers them with redis-py's ``register_script``, which
runs them by SHA and reloads a script after ``NoScriptError`` (a Redis restart).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

from redis.commands.core import Script

__all__ = ["SCRIPT_NAMES", "ScriptSet", "script_source"]

#: Every script the package runs; ``<name>.lua`` must exist beside this module.
SCRIPT_NAMES = (
    "acquire",
    "renew",
    "lapse",
    "release",
    "store",
    "claim",
    "cancel",
    "redrive",
    "metrics",
    "gaps",
    "fenced_write",
    "expire",
    "restore",
)


@cache
def script_source(name: str) -> str:
    """Return the Lua source of a script by name (``"acquire"`` reads ``acquire.lua``)."""
    if name not in SCRIPT_NAMES:
        raise KeyError(f"unknown lease script {name!r}")
    return resources.files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")


class ScriptSet:
    """The package's scripts registered on one Redis client."""

    def __init__(self, client: Any) -> None:
        self.acquire: Script = client.register_script(script_source("acquire"))
        self.renew: Script = client.register_script(script_source("renew"))
        self.lapse: Script = client.register_script(script_source("lapse"))
        self.release: Script = client.register_script(script_source("release"))
        self.store: Script = client.register_script(script_source("store"))
        self.claim: Script = client.register_script(script_source("claim"))
        self.cancel: Script = client.register_script(script_source("cancel"))
        self.redrive: Script = client.register_script(script_source("redrive"))
        self.metrics: Script = client.register_script(script_source("metrics"))
        self.gaps: Script = client.register_script(script_source("gaps"))
        self.expire: Script = client.register_script(script_source("expire"))
        self.restore: Script = client.register_script(script_source("restore"))
