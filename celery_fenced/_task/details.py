"""Progress details: what ``progress(**details)`` may carry, and how the lease holds it.

Details are the checkpoint a new owner resumes from after a takeover, so they must be JSON
and small: :func:`check_details` refuses anything else at the call, cheaply (no encoding
for the usual few scalars); :func:`encode_details` is the form the lease's ``details``
field holds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ..conf import DEFAULTS

__all__ = ["check_details", "encode_details"]

# Upper bounds of a value's JSON size, so that the usual small details need no encoding at the
# call: a character is at most 6 bytes (``\u0000``), a float's repr at most 24 characters.
_CHAR_BOUND = 6
_FLOAT_BOUND = 24
_INT_BOUND = 20  # digits and sign of an int below 10**19
_SMALL_INT = 10**19


def encode_details(details: Mapping[str, Any]) -> str:
    """Progress details as the lease's ``details`` field holds them: compact UTF-8 JSON."""
    return json.dumps(details, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def check_details(details: Mapping[str, Any], max_bytes: int = DEFAULTS["fenced_max_detail_bytes"]) -> None:
    """Refuse progress details that cannot be a checkpoint, cheaply (no encoding when small).

    Any JSON value is a detail: str, int, float, bool, None, and lists and dicts of them (the
    ids of the batches done, say). Scalars are bounded without encoding; a list or a dict is
    encoded once to check it.

    Raises:
        TypeError: a value JSON cannot hold (bytes, a set, an object, a dict with non-str keys).
        ValueError: a float that JSON cannot hold (NaN, infinity), or details whose JSON is
            larger than ``max_bytes``.
    """
    bound = 2
    for key, value in details.items():
        kind = type(value)
        if kind is str:
            bound += len(value) * _CHAR_BOUND + 2
        elif kind is int:
            bound += _INT_BOUND if -_SMALL_INT < value < _SMALL_INT else max_bytes + 1
        elif kind is float:
            if not math.isfinite(value):
                raise ValueError(f"progress detail {key!r} must be a finite number to be JSON, got {value!r}")
            bound += _FLOAT_BOUND
        elif kind is bool or value is None:
            bound += 5
        elif kind is list or kind is dict or kind is tuple:
            bound += _nested_size(key, value, max_bytes)
        else:
            raise TypeError(f"progress detail {key!r} must be a JSON value, got {type(value).__name__}")
        bound += len(key) * _CHAR_BOUND + 4
    if bound > max_bytes:
        try:
            size = len(encode_details(details).encode("utf-8"))
        except ValueError as exc:  # an int too long to print
            raise ValueError(f"progress details cannot be JSON: {exc}") from None
        if size > max_bytes:
            raise ValueError(
                f"progress details are {size} bytes of JSON, more than fenced_max_detail_bytes ({max_bytes}): "
                "a checkpoint says where to resume (a count, an offset, an id), it does not carry the data"
            )


def _nested_size(key: str, value: Any, max_bytes: int) -> int:
    """The JSON size of a list or dict detail (encoded: its parts are checked on the way)."""
    try:
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8"))
    except ValueError:
        raise ValueError(f"progress detail {key!r} must be JSON: it holds a NaN or an infinity") from None
    except TypeError as exc:
        raise TypeError(f"progress detail {key!r} must be a JSON value: {exc}") from None
    except RecursionError:
        raise ValueError(f"progress detail {key!r} nests too deep to be JSON") from None
