"""``LeaseState``: a snapshot whose attributes come from the lease hash's schema."""

from __future__ import annotations

import datetime
import pickle

import pytest
from kombu.utils import json

from celery_fenced._lease import fields as lease_fields
from celery_fenced._lease.fields import FIELDS, KIND_TYPES, LeaseField
from celery_fenced._lease.state import LeaseState

#: What LeaseState has besides the schema's fields.
OWN = {"task_id": "str", "raw": "Mapping[str, str]"}


def test_every_schema_field_is_an_attribute_read_as_its_kind() -> None:
    raw = {"status": "RUNNING", "ownerToken": "7", "leaseExpireAt": "1700000000000", "details": '{"rows": 3}'}
    state = LeaseState.from_fields("t1", raw)
    assert (state.status, state.owner_token, state.lease_expire_at, state.details) == (
        "RUNNING",
        7,
        1_700_000_000_000,
        {"rows": 3},
    )
    empty = LeaseState.from_fields("t2", {})
    for field in FIELDS.values():
        assert getattr(empty, field.attribute) == field.empty, field.name
    assert (empty.owner_id, empty.attempt, empty.heartbeat_at, empty.call, empty.details) == ("", 0, None, None, {})
    assert empty.lease_ttl_ms == 0  # leaseTtl, named for its unit


def test_a_new_schema_field_is_an_attribute_without_a_change_to_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(lease_fields.FIELDS, "pausedAt", LeaseField("pausedAt", "time", "when it was paused"))
    state = LeaseState.from_fields("t1", {"pausedAt": "1700000000123"})
    assert state.paused_at == 1_700_000_000_123  # type: ignore[attr-defined]
    assert LeaseState.from_fields("t1", {}).paused_at is None  # type: ignore[attr-defined]


def test_the_declared_attributes_are_the_schemas() -> None:
    """The annotations the type checker reads name schema fields only, each typed as its kind."""
    declared = {name: kind for name, kind in LeaseState.__annotations__.items() if name not in OWN}
    by_attribute = {field.attribute: field for field in FIELDS.values()}
    assert set(declared) <= set(by_attribute), set(declared) - set(by_attribute)
    for name, annotation in declared.items():
        field = by_attribute[name]
        expected = "Mapping[str, Any]" if field.empty == {} else KIND_TYPES[field.kind]
        assert annotation == expected, name


def test_the_recorded_call_is_read_as_kombu_wrote_it() -> None:
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    call = {"task": "proj.t", "args": [when], "kwargs": {}, "options": {}}
    state = LeaseState.from_fields("t1", {"call": json.dumps(call)})
    assert state.call == call
    assert LeaseState.from_fields("t1", {"call": "not json"}).call is None
    assert LeaseState.from_fields("t1", {"details": "[1, 2]"}).details == {}
    first, second = LeaseState.from_fields("t1", {}), LeaseState.from_fields("t2", {})
    assert json.dumps(first.details) == "{}" and first.details is not second.details  # each its own


def test_a_snapshot_is_read_only_and_compares_by_its_fields() -> None:
    state = LeaseState.from_fields("t1", {"status": "DONE", "ownerToken": "3"})
    with pytest.raises(AttributeError, match="read-only"):
        state.status = "RUNNING"  # type: ignore[misc]
    assert state == LeaseState.from_fields("t1", {"status": "DONE", "ownerToken": "3"})
    assert state != LeaseState.from_fields("t1", {"status": "DONE", "ownerToken": "4"})
    assert pickle.loads(pickle.dumps(state)) == state
    assert "status='DONE'" in repr(state) and "owner_token=3" in repr(state)
    assert state.is_finished and not state.is_live
