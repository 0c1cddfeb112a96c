"""docs/celery-features.rst names, for each Celery feature, the test that shows what a lease does
with it: each name must be a test function of that module, and each feature must have a row."""

from __future__ import annotations

import ast
import re

from tests.tiers import ROOT

PAGE = ROOT / "docs" / "celery-features.rst"

#: The features the page must cover (issue 52: one row each).
FEATURES = (
    "self.retry()",
    "autoretry_for",
    "rate_limit",
    "soft_time_limit",
    "ignore_result",
    "result_expires",
    "link",
    "link_error",
    "chains",
    "chords",
    "groups",
    "self.replace()",
    "revoke()",
    "revoke(terminate=True)",
    "countdown",
    "acks_late",
    "prefetch",
    "task_track_started",
)


def rows() -> list[str]:
    """The first cell of each row of the page's table."""
    return re.findall(r"^   \* - (.+)$", PAGE.read_text(), flags=re.M)


def test_every_feature_has_a_row() -> None:
    cells = rows()
    missing = [feature for feature in FEATURES if not any(feature in cell for cell in cells)]
    assert not missing, f"docs/celery-features.rst has no row for {missing}"


def test_every_test_the_page_names_exists() -> None:
    named = re.findall(r"``(tests/[\w/]+\.py)::(\w+)``", PAGE.read_text())
    assert len(named) >= len(FEATURES)
    missing = []
    for path, name in named:
        module = ROOT / path
        tree = ast.parse(module.read_text()) if module.is_file() else ast.Module(body=[], type_ignores=[])
        functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        if name not in functions or not name.startswith("test_"):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/celery-features.rst names tests that do not exist: {missing}"
