"""Progress details: refused at the call when no checkpoint can hold them, published when changed."""

from __future__ import annotations

import json
import math

import pytest

from celery_fenced._task.details import check_details, encode_details
from celery_fenced._task.owner import OwnedLease
from celery_fenced.conf import FencedConfig


def lease_with(max_bytes: int = 4096) -> OwnedLease:
    policy = FencedConfig.from_mapping({"fenced_max_detail_bytes": max_bytes}).policy
    return OwnedLease("t1", "proj.task", "host/1/a", 7, 1, 0, policy)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_float_json_cannot_hold_is_refused_at_the_call(value: float) -> None:
    with pytest.raises(ValueError, match="progress detail 'ratio' must be a finite number"):
        lease_with().progress("load", {"ratio": value})


@pytest.mark.parametrize("value", [b"x", object(), 1j, {1, 2}, [1, object()], {"a": {"b": b"x"}}])
def test_a_value_json_cannot_hold_is_refused_at_the_call(value: object) -> None:
    with pytest.raises(TypeError, match="progress detail 'v' must be a JSON value"):
        lease_with().progress("load", {"v": value})


def test_lists_and_dicts_are_details_too() -> None:
    lease = lease_with()
    details = {"done_batches": [1, 2, 5], "cursor": {"page": 3, "ids": ["a", "b"]}, "empty": []}
    lease.progress("load", details)
    report, _ = lease.report(0.0)
    assert json.loads(report.details) == details
    with pytest.raises(ValueError, match="'ratios' must be JSON: it holds a NaN"):
        lease.progress("load", {"ratios": [0.5, math.nan]})


def test_a_nested_detail_counts_toward_the_limit() -> None:
    with pytest.raises(ValueError, match="more than fenced_max_detail_bytes \\(64\\)"):
        lease_with(max_bytes=64).progress("load", {"ids": list(range(100))})


def test_details_over_the_limit_are_refused_with_their_size_and_the_setting() -> None:
    lease = lease_with(max_bytes=64)
    with pytest.raises(ValueError, match=r"are 7\d bytes of JSON, more than fenced_max_detail_bytes \(64\)"):
        lease.progress("load", {"text": "x" * 64})
    assert lease.details == {} and lease.version == 0  # a refused call changes nothing


def test_the_limit_is_the_exact_size_of_the_json_not_its_bound() -> None:
    details = {"text": "é" * 20, "done": 12345678901234567890, "ok": True, "none": None}
    size = len(encode_details(details).encode("utf-8"))
    check_details(details, size)  # exactly at the limit: accepted
    with pytest.raises(ValueError, match=f"are {size} bytes"):
        check_details(details, size - 1)


def test_published_details_are_compact_utf8_json_that_reads_back_the_same() -> None:
    details = {"done": 6, "name": "rapport é", "ratio": 0.1, "last": None, "ok": False}
    text = encode_details(details)
    assert json.loads(text) == details
    assert " " not in text.replace("rapport é", "")


def test_the_report_carries_details_only_until_a_renewal_wrote_them() -> None:
    lease = lease_with()
    report, _ = lease.report(0.0)
    assert report.details == ""  # nothing given yet: nothing to publish
    lease.progress("process", {"done": 3})
    report, sent = lease.report(0.0)
    assert json.loads(report.details) == {"done": 3} and report.stage == "process" and report.version == 1
    lease.watch.renewed_at(lease.renewed, sent)  # what the heartbeat does once the renewal is accepted
    lease.progress("process")  # progress without details keeps the last ones, published
    assert lease.report(0.0)[0].details == ""
    lease.progress("process", {"done": 4})
    assert json.loads(lease.report(0.0)[0].details) == {"done": 4}
