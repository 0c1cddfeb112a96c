"""A bounded memo of names made from names: :class:`NameMemo`.

Stage names come from task code and may be dynamic (``f"page-{n}"``); what is made from
them once per process (a normalised stage, a metric series) is remembered for at most
``limit`` of them, and made afresh beyond.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["NAME_MEMO_LIMIT", "NameMemo"]

#: How many names a memo remembers.
NAME_MEMO_LIMIT = 1024

K = TypeVar("K", bound=Hashable)


class NameMemo(Generic[K]):
    """``memo(key)`` is ``make(key)``, remembered for the first ``limit`` keys.

    :attr:`made` is the dict itself, for a hot path's own ``try: made[key]`` lookup.
    """

    def __init__(self, make: Callable[[K], str], limit: int = NAME_MEMO_LIMIT) -> None:
        self.made: dict[K, str] = {}
        self._make = make
        self._limit = limit

    def __call__(self, key: K) -> str:
        try:
            return self.made[key]
        except KeyError:
            value = self._make(key)
            if len(self.made) < self._limit:
                self.made[key] = value
            return value
