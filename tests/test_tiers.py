"""tests/tiers.py names only what exists: an entry that rots would silently drop a module from
the older combinations, or keep one on them that was meant to run once."""

from __future__ import annotations

import pytest

from tests.tiers import EVERY_COMBINATION, ONLY_ON_THE_NEWEST, ROOT, runs_on_every_combination


@pytest.mark.parametrize("entry", sorted({**EVERY_COMBINATION, **ONLY_ON_THE_NEWEST}))
def test_every_entry_names_a_test_module_or_folder(entry: str) -> None:
    path = ROOT / entry
    assert path.is_dir() or (path.is_file() and path.name.startswith("test_")), f"tests/tiers.py: no {entry}"


@pytest.mark.parametrize("entry", sorted(ONLY_ON_THE_NEWEST))
def test_what_runs_once_is_inside_a_folder_that_runs_everywhere(entry: str) -> None:
    assert not runs_on_every_combination(ROOT / entry)
    assert any(entry.startswith(folder + "/") for folder in EVERY_COMBINATION), entry


def test_the_unit_tests_run_on_every_combination_and_the_operator_view_once() -> None:
    assert runs_on_every_combination(ROOT / "tests/unit/test_conf.py")
    assert not runs_on_every_combination(ROOT / "tests/integration/test_operator_view.py")
