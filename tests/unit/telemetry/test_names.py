"""The bounded memo of names made from names (_telemetry/names.py): remembered up to its limit,
made afresh beyond it."""

from __future__ import annotations

from celery_fenced._telemetry.names import NAME_MEMO_LIMIT, NameMemo


def recording_upper(made: list[str]) -> NameMemo[str]:
    """A memo of upper-cased names that records each name it makes."""

    def make(name: str) -> str:
        made.append(name)
        return name.upper()

    return NameMemo(make, limit=2)


def test_a_name_memo_remembers_a_bounded_number_of_names() -> None:
    made: list[str] = []
    memo = recording_upper(made)
    assert [memo(n) for n in ("a", "b", "a", "c", "c")] == ["A", "B", "A", "C", "C"]
    assert made == ["a", "b", "c", "c"]  # "c" came after the limit: made each time, never kept
    assert memo.made == {"a": "A", "b": "B"}


def test_what_it_made_is_the_dict_a_hot_path_reads() -> None:
    memo = recording_upper([])
    memo("a")
    made = memo.made
    memo("b")
    assert made is memo.made and made["b"] == "B"


def test_a_memo_remembers_a_thousand_and_twenty_four_names_unless_told() -> None:
    memo: NameMemo[int] = NameMemo(str)
    for n in range(NAME_MEMO_LIMIT + 10):
        assert memo(n) == str(n)
    assert NAME_MEMO_LIMIT == 1024 and len(memo.made) == NAME_MEMO_LIMIT
