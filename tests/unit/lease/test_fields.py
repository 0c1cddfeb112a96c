"""The lease hash's schema, the scripts and docs/design.rst say the same fields."""

from __future__ import annotations

import re
from pathlib import Path

from celery_fenced._lease.fields import FIELDS, is_time, typed
from celery_fenced._operator.listing import render_lease, typed_fields

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = ROOT / "celery_fenced" / "_lease" / "scripts"
FIELD_NAME = re.compile(r"^[a-z][A-Za-z]*$")
# Commands on a hash, and which of their arguments (after the key) name fields.
FIELD_ARGUMENTS = {"HSET": "pairs", "HGET": "all", "HMGET": "all", "HDEL": "all", "HEXISTS": "all", "HINCRBY": "first"}


def _arguments(text: str, start: int) -> list[str]:
    """The top-level, comma-separated arguments of the call whose ``(`` is at ``start``."""
    depth, current, arguments = 0, "", []
    for char in text[start:]:
        if char in "({":
            depth += 1
            if depth == 1:
                continue
        elif char in ")}":
            depth -= 1
            if depth == 0:
                arguments.append(current.strip())
                return arguments
        elif char == "," and depth == 1:
            arguments.append(current.strip())
            current = ""
            continue
        current += char
    raise AssertionError("unbalanced call")


def _literal(argument: str) -> str | None:
    match = re.fullmatch(r"'([^']*)'", argument)
    return match.group(1) if match and FIELD_NAME.match(match.group(1)) else None


def _fields_in_scripts() -> set[str]:
    found: set[str] = set()
    for path in SCRIPTS.glob("*.lua"):
        text = "\n".join(line.split("--", 1)[0] for line in path.read_text().splitlines())
        for call in re.finditer(r"redis\.call\(\s*'(H[A-Z]+)'", text):
            arguments = _arguments(text, call.start() + len("redis.call"))[2:]
            if call.group(1) == "HGETALL" or call.group(1) not in FIELD_ARGUMENTS:
                continue
            rule = FIELD_ARGUMENTS[call.group(1)]
            names = arguments[::2] if rule == "pairs" else arguments[:1] if rule == "first" else arguments
            found |= {name for name in map(_literal, names) if name}
        for table in re.finditer(r"local fields = \{", text):  # field, value, field, value, …
            found |= {name for name in map(_literal, _arguments(text, table.end() - 1)[::2]) if name}
        found |= set(re.findall(r"fields\[#fields \+ 1\] = '([a-z][A-Za-z]*)'", text))
    return found


def test_the_scripts_write_and_read_exactly_the_fields_of_the_schema() -> None:
    found = _fields_in_scripts()
    assert found - set(FIELDS) == set(), "fields the scripts use that the schema does not name"
    assert set(FIELDS) - found == set(), "fields of the schema no script uses"


def test_the_design_doc_lists_the_schema_as_it_is() -> None:
    text = (ROOT / "docs" / "design.rst").read_text()
    rows = re.findall(r"^``(\w+)``\s+(text|int|time|json)\s+(.+)$", text, re.MULTILINE)
    assert [(name, kind, meaning.rstrip()) for name, kind, meaning in rows] == [
        (f.name, f.kind, f.meaning) for f in FIELDS.values()
    ]


def test_values_are_typed_by_the_schema_not_by_their_look() -> None:
    raw = {
        "ownerToken": "7",
        "currentStage": "2024",  # a stage named by digits stays text
        "leaseExpireAt": "1700000000000",
        "details": '{"done":3}',
        "call": "not json",
        "someNewField": "12",  # written by a newer version: kept as text
    }
    assert typed(raw) == {
        "ownerToken": 7,
        "currentStage": "2024",
        "leaseExpireAt": 1_700_000_000_000,
        "details": {"done": 3},
        "call": "not json",
        "someNewField": "12",
    }
    assert typed_fields(raw) == typed(raw)
    assert is_time("lastProgressAt") and not is_time("ownerToken") and not is_time("unknownAt")


def test_inspect_shows_only_the_schemas_times_as_dates() -> None:
    shown = render_lease("t1", typed({"leaseExpireAt": "1700000000000", "ownerToken": "1700000000000"}), 1700000001000)
    assert "leaseExpireAt" in shown and "2023-11-14" in shown.split("leaseExpireAt", 1)[1].splitlines()[0]
    assert "2023" not in shown.split("ownerToken", 1)[1].splitlines()[0]
