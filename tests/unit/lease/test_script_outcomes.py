"""Each script's codes, as its ``.lua`` header states them, are exactly its outcome enum."""

from __future__ import annotations

import re

import pytest

from celery_fenced._lease.scripts import SCRIPT_NAMES, script_header
from celery_fenced._lease.state import SCRIPT_OUTCOMES

#: Scripts that answer with something other than a code (a count, a token).
NO_CODES = {
    "metrics",
    "gaps",
    "fenced_write",
    "lapse_reserved",
    "take_tokens",
    "trace_context",
    "unreserve",
    "worker_alive",
    "worker_left",
}


def header_codes(name: str) -> set[str]:
    """The codes a script's "Returns" header names.

    A code is a quoted word that opens the list after "Returns …:", follows a "|", or opens a
    line of the list indented by two or three spaces; quoted words inside the descriptions
    (causes, arguments) are indented further or follow other text.
    """
    lines = script_header(name).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("-- Returns"))
    codes: set[str] = set()
    for line in lines[start:]:
        if not line.startswith("--"):
            break
        text = line[2:]
        if line.startswith("-- Returns"):
            text = text.split(":", 1)[1] if ":" in text else ""
            codes.update(re.findall(r'^\s*"([a-z-]+)"', text))
        else:
            codes.update(re.findall(r'^ {2,3}"([a-z-]+)"', text))
        codes.update(re.findall(r'\|\s*"([a-z-]+)"', text))
    return codes


def test_every_script_has_an_outcome_enum_or_answers_no_code() -> None:
    assert set(SCRIPT_OUTCOMES) | NO_CODES == set(SCRIPT_NAMES)
    assert not set(SCRIPT_OUTCOMES) & NO_CODES


@pytest.mark.parametrize("name", sorted(SCRIPT_OUTCOMES))
def test_a_scripts_header_names_exactly_its_outcomes(name: str) -> None:
    assert header_codes(name) == {member.value for member in SCRIPT_OUTCOMES[name]}


@pytest.mark.parametrize("name", sorted(SCRIPT_OUTCOMES))
def test_a_scripts_body_answers_only_its_outcomes(name: str) -> None:
    body = "\n".join(line for line in script_header(name).splitlines() if not line.startswith("--"))
    answered = set(re.findall(r"return \{'([a-z-]+)'", body))
    answered |= set(re.findall(r"\bcode = '([a-z-]+)'", body))
    answered |= set(re.findall(r"\bcodes\[#codes \+ 1\] = '([a-z-]+)'", body))
    assert answered, f"{name}.lua answers no code this test can see"
    assert answered <= {member.value for member in SCRIPT_OUTCOMES[name]}
