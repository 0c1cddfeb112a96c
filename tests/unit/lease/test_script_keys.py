"""Every key a script reads or writes is named in its KEYS: an ACL key pattern, a proxy that
routes by key and Redis Cluster's slot check see them all. A script never takes a key from a
reply (a set's members are read by the caller and passed in, as for ``lapse_worker``)."""

from __future__ import annotations

import re

import pytest

from celery_fenced._lease.scripts import SCRIPT_NAMES, script_source

#: Commands whose first argument is not a key.
KEYLESS = {"INFO", "TIME", "PUBLISH"}

_CALL = re.compile(r"redis\.p?call\('([A-Z]+)',\s*([^,)]+)")
_FUNCTION = re.compile(r"local function (\w+)\(([^)]*)\)")
_ASSIGNED = re.compile(r"(?<![\w.])(\w+)\s*=(?!=)\s*([^\n]+)")
_LOOP = re.compile(r"\bfor\s+([\w\s,]+?)\s+in\s+([^\n]+?)\s+do\b")


def _from_keys(expression: str) -> bool:
    return expression.strip().startswith("KEYS[")


def key_names(source: str) -> set[str]:
    """The names in ``source`` that only ever hold a KEYS entry: locals assigned from KEYS (and
    from nothing else), loop variables over ``ipairs(KEYS)``, and the parameters of the shared
    functions that every call passes one of those (or a KEYS entry) in that place."""
    assigned: dict[str, list[str]] = {}
    for name, expression in _ASSIGNED.findall(source):
        assigned.setdefault(name, []).append(expression)
    for names, expression in _LOOP.findall(source):
        for name in (n.strip() for n in names.split(",")):
            assigned.setdefault(name, []).append("KEYS[" if expression.strip() == "ipairs(KEYS)" else expression)
    names = {name for name, expressions in assigned.items() if all(map(_from_keys, expressions))}
    functions = {
        name: [p.strip() for p in params.split(",") if p.strip()] for name, params in _FUNCTION.findall(source)
    }
    changed = True
    while changed:  # a shared function's parameter is a key when every call passes one
        changed = False
        for function, params in functions.items():
            for place, param in enumerate(params):
                if param in names or param in assigned:
                    continue
                calls = [
                    [a.strip() for a in args.split(",")]
                    for args in re.findall(rf"(?<!function )\b{function}\(([^()]*)\)", source)
                ]
                if calls and all(
                    len(args) > place and (_from_keys(args[place]) or args[place] in names) for args in calls
                ):
                    names.add(param)
                    changed = True
    return names


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_every_key_a_script_touches_is_named_in_its_keys(name: str) -> None:
    source = script_source(name)
    names = key_names(source)
    for command, first in _CALL.findall(source):
        if command in KEYLESS:
            continue
        first = first.strip()
        assert _from_keys(first) or first in names, f"{name}.lua: {command} {first} is not a key named in KEYS"


def test_a_key_taken_from_a_reply_is_caught() -> None:
    # What lapse_worker.lua did: the lease keys came from ZRANGE.
    source = """
for _, key in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
  local f = redis.call('HMGET', key, 'status')
end
"""
    assert "key" not in key_names(source)
    assert "lease" in key_names("local lease = KEYS[2]\nredis.call('HGET', lease, 'x')")
